// Device side of the collectives executor (uniep/cuda/collectives.hpp): the bounded wait on
// arrival signals, the fallback signal store, and the fixed-order reduction.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/common/device_wait.cuh"
#include "uniep/cpu_executor.hpp"  // DType

namespace uniep::cuda {

constexpr int kCollMaxRanks = 16;

// Error-word op codes of the collectives: kCollOpBase + CollectiveKind.
constexpr uint32_t kCollOpBase = 16;

// Waits until words[p * stride] >= want for every p in [0, world) but `rank` (only p == `only`
// when only >= 0). Bounded: at the deadline it records (op, peer) in err and returns; it returns at
// once if an error is already recorded: one timeout must not cost one timeout per later wait.
void launch_coll_wait(const uint64_t* words, int64_t stride, int world, int rank, int only,
                      uint64_t want, uint64_t timeout_ns, DeviceError* err, uint32_t op,
                      cudaStream_t stream);

// *word = value with release semantics at system scope (when the driver's stream write is not
// available).
void launch_coll_signal(uint64_t* word, uint64_t value, cudaStream_t stream);

// out[e] = round(((in[0][e] + in[1][e]) + ...) + in[count-1][e]), accumulated in fp32 (fp64 for
// float64): the CPU executor's reduce-order fold, bit for bit. 16-byte vectors where every
// pointer is aligned to them. The grid is one wave of resident blocks on `sm_count` SMs at most.
struct ReduceInputs {
  const void* in[kCollMaxRanks];
};
void launch_coll_reduce(DType dtype, const ReduceInputs& inputs, int count, void* out,
                        int64_t elems, int sm_count, cudaStream_t stream);

}  // namespace uniep::cuda
