// Combine: each expert output row goes to slot (token, k) of its source rank; the source then
// reduces over k in ascending order in fp32. Slot-indexed, so the result never depends on which
// block carried a row or when it arrived. The products and sums are rounded one by one
// (__fmul_rn/__fadd_rn, no FMA contraction) exactly as the CPU executor does them, so equal
// inputs give equal bits on both.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 256;

__global__ void __launch_bounds__(kThreads)
    combine_kernel(SymmetricView sym, EpDims d, CombineArgs a) {
  __shared__ unsigned long long sent[kMaxRanks];
  const int64_t W = d.world_size, K = d.top_k, me = d.rank, H = d.hidden;
  const int64_t row_bytes = H * 2, per_rank = d.max_tokens * K;
  const uint64_t deadline = global_timer_ns() + a.timeout_ns;
  const int lane = threadIdx.x % 32;
  for (int64_t i = threadIdx.x; i < W; i += blockDim.x) sent[i] = 0;
  __syncthreads();

  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = warp; r < a.rows; r += num_warps) {
    const int64_t target = a.row_target[r];
    const int pe = static_cast<int>(target / per_rank);
    nvshmemx_putmem_nbi_warp(sym.combine + (target % per_rank) * row_bytes, a.y + r * row_bytes,
                             row_bytes, pe);
    if (lane == 0) atomicAdd(&sent[pe], 1ull);
  }
  nvshmem_quiet();
  __syncthreads();
  for (int64_t dst = threadIdx.x; dst < W; dst += blockDim.x) {
    if (sent[dst] > 0)
      nvshmemx_signal_op(&sym.signals[kCombineSignal * W + me], sent[dst], NVSHMEM_SIGNAL_ADD,
                         static_cast<int>(dst));
  }
  __shared__ int waits_failed;
  if (threadIdx.x == 0) waits_failed = 0;
  __syncthreads();
  for (int64_t s = threadIdx.x; s < W; s += blockDim.x) {
    const uint64_t want = a.plan.rows_back[s];
    if (want > 0 && !wait_at_least(&sym.signals[kCombineSignal * W + s], want, deadline, a.err,
                                   WaitOp::kCombine, static_cast<int>(s)))
      atomicAdd(&waits_failed, 1);
  }
  __threadfence();
  __syncthreads();
  if (waits_failed) return;

  const int64_t vecs = H / 8;  // 8 bf16 per 16-byte vector; H % 8 == 0 is checked on the host
  for (int64_t t = blockIdx.x; t < a.tokens; t += gridDim.x) {
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int64_t k = 0; k < K; ++k) {
        if (a.topk_idx[t * K + k] < 0) continue;
        const float w = a.topk_weights[t * K + k];
        const int4 raw = reinterpret_cast<const int4*>(sym.combine + (t * K + k) * row_bytes)[v];
        const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, __bfloat162float(y[i])));
      }
      int4 packed;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[i]);
      reinterpret_cast<int4*>(a.out + t * row_bytes)[v] = packed;
    }
  }
}

}  // namespace

void launch_combine(const SymmetricView& sym, const EpDims& d, const CombineArgs& a, int blocks,
                    cudaStream_t stream) {
  combine_kernel<<<blocks, kThreads, 0, stream>>>(sym, d, a);
}

}  // namespace uniep::cuda
