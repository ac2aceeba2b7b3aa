// Combine: each expert output row goes to slot (token, k) of its source rank; the source then
// reduces over k in ascending order in fp32. Slot-indexed, so the result never depends on which
// block carried a row or when it arrived. The products and sums are rounded one by one
// (__fmul_rn/__fadd_rn, no FMA contraction) exactly as the CPU executor does them, so equal
// inputs give equal bits on both.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 256;

__global__ void __launch_bounds__(kThreads, 1)
    combine_send_kernel(SymmetricView sym, EpDims d, CombineArgs a) {
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
    uint8_t* slot = sym.combine + (target % per_rank) * row_bytes;
    auto* peer_slot = static_cast<uint8_t*>(nvshmem_ptr(slot, pe));
    if (peer_slot != nullptr) {
      warp_copy(peer_slot, a.y + r * row_bytes, row_bytes, lane);
    } else {
      nvshmemx_putmem_nbi_warp(slot, a.y + r * row_bytes, row_bytes, pe);
    }
    if (lane == 0) atomicAdd(&sent[pe], 1ull);
  }
  nvshmem_quiet();
  __syncthreads();
  for (int64_t dst = threadIdx.x; dst < W; dst += blockDim.x) {
    if (sent[dst] > 0)
      nvshmemx_signal_op(&sym.signals[kCombineSignal * W + me], sent[dst], NVSHMEM_SIGNAL_ADD,
                         static_cast<int>(dst));
  }
  // One block waits for every row owed to us; the reduction kernel runs after this one.
  if (blockIdx.x != 0) return;
  for (int64_t s = threadIdx.x; s < W; s += blockDim.x) {
    const uint64_t want = a.plan.rows_back[s];
    if (want > 0)
      wait_at_least(&sym.signals[kCombineSignal * W + s], want, deadline, a.err, WaitOp::kCombine,
                    static_cast<int>(s));
  }
}

// out[t] = sum_k w[t,k] * y_(t,k) over valid k, ascending, one thread per 8 columns of a token.
__global__ void combine_reduce_kernel(SymmetricView sym, EpDims d, CombineArgs a) {
  const int64_t K = d.top_k, H = d.hidden, row_bytes = H * 2, vecs = H / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.tokens * vecs;
       i += stride) {
    const int64_t t = i / vecs, v = i % vecs;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < K; ++k) {
      if (a.topk_idx[t * K + k] < 0) continue;
      const float w = a.topk_weights[t * K + k];
      const int4 raw =
          load_streaming(reinterpret_cast<const int4*>(sym.combine + (t * K + k) * row_bytes) + v);
      const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, __bfloat162float(y[j])));
    }
    int4 packed;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16_rn(acc[j]);
    reinterpret_cast<int4*>(a.out + t * row_bytes)[v] = packed;
  }
}

}  // namespace

void launch_combine(const SymmetricView& sym, const EpDims& d, const CombineArgs& a, int blocks,
                    int reduce_blocks, cudaStream_t stream) {
  combine_send_kernel<<<blocks, kThreads, 0, stream>>>(sym, d, a);
  if (a.tokens > 0) combine_reduce_kernel<<<reduce_blocks, 256, 0, stream>>>(sym, d, a);
}

}  // namespace uniep::cuda
