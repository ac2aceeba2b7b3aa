// Dispatch: each warp takes tokens and puts the row, its source index and its routing into the
// token's receive slot on every destination rank (once per rank, however many of its experts live
// there). Slots come from the plan, so where a row lands never depends on which warp, block or
// SM budget carried it, nor on arrival order.
//
// Completion: each block counts the rows it sent to each rank and, after nvshmem_quiet (its puts
// are visible at the target), adds that count to the target's signal for this source. A receiver
// waits until each source's signal reaches the count agreed in notify, then copies its slots out.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxRanks = 256;

__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(SymmetricView sym, EpDims d, DispatchArgs a) {
  __shared__ unsigned long long sent[kMaxRanks];
  const int64_t W = d.world_size, K = d.top_k, me = d.rank, meta_len = 1 + K;
  const uint64_t deadline = global_timer_ns() + a.timeout_ns;
  const int lane = threadIdx.x % 32;
  for (int64_t i = threadIdx.x; i < W; i += blockDim.x) sent[i] = 0;
  __syncthreads();

  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t t = warp; t < a.tokens; t += num_warps) {
    for (int64_t dst = 0; dst < W; ++dst) {
      const int64_t slot = a.send_slot[t * W + dst];
      if (slot < 0) continue;
      const int pe = static_cast<int>(dst);
      nvshmemx_putmem_nbi_warp(sym.recv_x + slot * d.row_cap, a.x + t * a.row_bytes,
                               a.row_bytes, pe);
      if (lane < meta_len) {
        const int64_t v = lane == 0 ? t : a.topk_idx[t * K + lane - 1];
        nvshmem_int64_p(sym.recv_meta + slot * meta_len + lane, v, pe);
      }
      if (lane < K) nvshmem_float_p(sym.recv_weights + slot * K + lane, a.topk_weights[t * K + lane], pe);
      if (lane == 0) atomicAdd(&sent[dst], 1ull);
    }
  }
  nvshmem_quiet();
  __syncthreads();
  for (int64_t dst = threadIdx.x; dst < W; dst += blockDim.x) {
    if (sent[dst] > 0)
      nvshmemx_signal_op(&sym.signals[kDispatchSignal * W + me], sent[dst], NVSHMEM_SIGNAL_ADD,
                         static_cast<int>(dst));
  }

  // Copy-out source by source, own rank first (its puts are local and land first), so rows of
  // early sources are copied while later ones are still on the wire.
  __shared__ bool abort;
  const int64_t first = me * d.experts_per_rank;
  for (int64_t i = 0; i < W; ++i) {
    const int64_t s = (me + i) % W;
    const int64_t begin = a.plan.recv_offsets[s], end = a.plan.recv_offsets[s + 1];
    if (begin == end) continue;
    if (threadIdx.x == 0) {
      abort = !wait_at_least(&sym.signals[kDispatchSignal * W + s],
                             static_cast<uint64_t>(end - begin), deadline, a.err,
                             WaitOp::kDispatch, static_cast<int>(s));
      __threadfence();
    }
    __syncthreads();
    if (abort) return;
    const int64_t vecs = a.row_bytes / 16;  // rows are 16-byte multiples (checked on the host)
    for (int64_t slot = begin + blockIdx.x; slot < end; slot += gridDim.x) {
      if (a.recv_x != nullptr) {
        const int4* src = reinterpret_cast<const int4*>(sym.recv_x + slot * d.row_cap);
        int4* out = reinterpret_cast<int4*>(a.recv_x + slot * a.row_bytes);
        for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) out[v] = src[v];
      }
      const int64_t* meta = sym.recv_meta + slot * meta_len;
      if (threadIdx.x == 0) a.recv_src[slot] = meta[0];
      if (threadIdx.x < K) {
        const int64_t g = meta[1 + threadIdx.x];
        const bool local = g >= first && g < first + d.experts_per_rank;
        a.recv_topk_idx[slot * K + threadIdx.x] = local ? g - first : -1;
        a.recv_topk_weights[slot * K + threadIdx.x] = sym.recv_weights[slot * K + threadIdx.x];
      }
    }
    __syncthreads();  // `abort` is rewritten by the next wait
  }
}

}  // namespace

void launch_dispatch(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a, int blocks,
                     cudaStream_t stream) {
  dispatch_kernel<<<blocks, kThreads, 0, stream>>>(sym, d, a);
}

}  // namespace uniep::cuda
