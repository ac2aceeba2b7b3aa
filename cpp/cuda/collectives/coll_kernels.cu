// Kernels of the collectives executor; see coll_kernels.hpp.
#include <cuda_bf16.h>

#include "cuda/collectives/coll_kernels.hpp"
#include "cuda/common/warp_copy.cuh"  // load_streaming

namespace uniep::cuda {
namespace {

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ bool error_recorded(const DeviceError* err) {
  return *reinterpret_cast<const volatile uint32_t*>(&err->op) != 0;
}

__global__ void coll_wait_kernel(const uint64_t* words, int64_t stride, int world, int rank,
                                 int only, uint64_t want, uint64_t timeout_ns, DeviceError* err,
                                 uint32_t op) {
  const int p = threadIdx.x;
  if (p >= world || p == rank || (only >= 0 && p != only) || error_recorded(err)) return;
  wait_at_least(words + p * stride, want, global_timer_ns() + timeout_ns, err,
                static_cast<WaitOp>(op), p);
}

__global__ void coll_signal_kernel(uint64_t* word, uint64_t value) {
  __threadfence_system();
  store_release_sys(word, value);
}

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  using Acc = float;
  __device__ static float load(const float* p) { return *p; }
  __device__ static void store(float* p, float v) { *p = v; }
};
template <>
struct Elem<double> {
  using Acc = double;
  __device__ static double load(const double* p) { return *p; }
  __device__ static void store(double* p, double v) { *p = v; }
};
template <>
struct Elem<__nv_bfloat16> {
  using Acc = float;
  __device__ static float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};

// Two 16-byte vectors per thread and iteration: the fold is memory-bound, and the sources are
// local HBM (the slots the peers pushed into, and this rank's own partial). Every input's vectors
// are loaded before the first is added, so a thread has 2 * `count` loads in flight at once
// instead of a chain of one round trip per input. kMaxIn bounds the unrolled loads: an array for
// kCollMaxRanks inputs took ~100 registers a thread, which capped the occupancy (and so the
// loads in flight) at a third of the SM's and the fold at about 60% of HBM bandwidth. The inputs
// are read once and not written during the kernel: streaming loads, no L1 allocation.
template <typename T, int kMaxIn>
__global__ void coll_reduce_kernel(ReduceInputs inputs, int count, T* out, int64_t elems,
                                   bool vectorized) {
  using Acc = typename Elem<T>::Acc;
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kUnroll = 2;
  const int64_t vecs = vectorized ? elems / kVec : 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v0 < vecs;
       v0 += kUnroll * stride) {
    int4 raw[kUnroll][kMaxIn];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int i = 0; i < kMaxIn; ++i)
        if (i < count && v0 + u * stride < vecs)
          raw[u][i] = load_streaming(reinterpret_cast<const int4*>(inputs.in[i]) + v0 + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v0 + u * stride >= vecs) break;
      Acc acc[kVec];
#pragma unroll
      for (int i = 0; i < kMaxIn; ++i) {
        if (i < count) {
          const T* x = reinterpret_cast<const T*>(&raw[u][i]);
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            // The first operand starts the sum: 0 + (-0) would lose the sign the CPU keeps.
            const Acc xv = Elem<T>::load(x + e);
            acc[e] = i == 0 ? xv : acc[e] + xv;
          }
        }
      }
      int4 packed;
      T* o = reinterpret_cast<T*>(&packed);
#pragma unroll
      for (int e = 0; e < kVec; ++e) Elem<T>::store(o + e, acc[e]);
      reinterpret_cast<int4*>(out)[v0 + u * stride] = packed;
    }
  }
  // The ragged end, or everything when a pointer is not 16-byte aligned: element by element.
  for (int64_t e = vecs * kVec + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       e < elems; e += stride) {
    Acc acc = 0;
    for (int i = 0; i < count; ++i) {
      const Acc xv = Elem<T>::load(static_cast<const T*>(inputs.in[i]) + e);
      acc = i == 0 ? xv : acc + xv;
    }
    Elem<T>::store(out + e, acc);
  }
}

// One wave of resident blocks (the kernel's occupancy times the SMs), or fewer for a small fold:
// a grid that does not fit leaves its last blocks to start after the first ones end.
template <typename T, int kMaxIn>
void launch_reduce(const ReduceInputs& inputs, int count, T* out, int64_t elems, int sm_count,
                   bool vectorized, cudaStream_t stream) {
  constexpr int kThreads = 256, kVecsPerThread = 2;
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, coll_reduce_kernel<T, kMaxIn>, kThreads,
                                                      0) != cudaSuccess)
      (void)cudaGetLastError();
    return n > 0 ? n : 1;
  }();
  const int64_t items = vectorized ? elems / (16 / sizeof(T)) : elems;
  const int64_t want = (items + kThreads * kVecsPerThread - 1) / (kThreads * kVecsPerThread);
  const int64_t wave = static_cast<int64_t>(per_sm) * sm_count;
  const int blocks = static_cast<int>(want < 1 ? 1 : want < wave ? want : wave);
  coll_reduce_kernel<T, kMaxIn>
      <<<blocks, kThreads, 0, stream>>>(inputs, count, out, elems, vectorized);
}

template <typename T>
void launch_reduce_typed(const ReduceInputs& inputs, int count, void* out, int64_t elems,
                         int sm_count, bool vectorized, cudaStream_t stream) {
  T* o = static_cast<T*>(out);
  if (count <= 2)
    launch_reduce<T, 2>(inputs, count, o, elems, sm_count, vectorized, stream);
  else if (count <= 4)
    launch_reduce<T, 4>(inputs, count, o, elems, sm_count, vectorized, stream);
  else if (count <= 8)
    launch_reduce<T, 8>(inputs, count, o, elems, sm_count, vectorized, stream);
  else
    launch_reduce<T, kCollMaxRanks>(inputs, count, o, elems, sm_count, vectorized, stream);
}

}  // namespace

void launch_coll_wait(const uint64_t* words, int64_t stride, int world, int rank, int only,
                      uint64_t want, uint64_t timeout_ns, DeviceError* err, uint32_t op,
                      cudaStream_t stream) {
  coll_wait_kernel<<<1, 32, 0, stream>>>(words, stride, world, rank, only, want, timeout_ns, err,
                                         op);
}

void launch_coll_signal(uint64_t* word, uint64_t value, cudaStream_t stream) {
  coll_signal_kernel<<<1, 1, 0, stream>>>(word, value);
}

void launch_coll_reduce(DType dtype, const ReduceInputs& inputs, int count, void* out,
                        int64_t elems, int sm_count, cudaStream_t stream) {
  bool vectorized = reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int i = 0; i < count; ++i)
    vectorized = vectorized && reinterpret_cast<uintptr_t>(inputs.in[i]) % 16 == 0;
  switch (dtype) {
    case DType::kFloat32:
      launch_reduce_typed<float>(inputs, count, out, elems, sm_count, vectorized, stream);
      break;
    case DType::kFloat64:
      launch_reduce_typed<double>(inputs, count, out, elems, sm_count, vectorized, stream);
      break;
    case DType::kBFloat16:
      launch_reduce_typed<__nv_bfloat16>(inputs, count, out, elems, sm_count, vectorized, stream);
      break;
  }
}

}  // namespace uniep::cuda
