// What the epilogues that store straight from the fp32 accumulators share (SwiGluEpilogue, the
// fused MoE kernel's FusedMoeEpilogue): the names and the static interface CUTLASS's
// operator-style ptr-array epilogues have (DefaultEpilogueArray), through which they run inside
// the warp-specialized kernels (cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter),
// and the SwiGLU arithmetic they apply alike.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/epilogue/dispatch_policy.hpp>

#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::grouped {

struct DirectStoreEpilogue {
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementC = void;  // no source operand
  using ElementD = Bf16;
  using ElementOutput = Bf16;
  using InternalStrideC = ::uniep::cuda::grouped::StrideD;
  using StrideC = InternalStrideC*;
  using InternalStrideD = ::uniep::cuda::grouped::StrideD;
  using StrideD = InternalStrideD*;
  // Named by the device adapter (GemmUniversalAdapter); never applied.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Bf16, 1, float, float>;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  // No shared memory: the mainloop keeps all of it for its stages.
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(const ProblemShape&, const Arguments&, int) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(const ProblemShape&, const Arguments&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // The chain's numerics and the CPU executor's: gate and up rounded to bf16 (where the chain
  // stored h), silu(g) * u in fp32.
  CUTLASS_DEVICE static float swiglu(float gate, float up) {
    const float g = static_cast<float>(Bf16(gate));
    const float u = static_cast<float>(Bf16(up));
    return g / (1.0f + expf(-g)) * u;
  }
};

}  // namespace uniep::cuda::grouped
