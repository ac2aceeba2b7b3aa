// Low-latency dispatch: no count exchange and no host sync. Region (local expert e, source s) on
// the expert's rank holds s's rows for e at positions 0, 1, ... in (token, k) order, so the
// layout is still a function of the routing alone. The count travels as a signal (rows + 1, so
// that zero rows is still an answer); the receiver resets it once read.
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cub/block/block_scan.cuh>

#include "cuda/common/ll_launch.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kMaxMatches = 4096;  // (token, k) pairs of one expert held in shared memory

__global__ void __launch_bounds__(kLlThreads, kLlMinBlocksPerSm)
    ll_dispatch_kernel(LowLatencyView ll, EpDims d, int b, const uint8_t* x,
                       const int64_t* topk_idx, int64_t tokens, uint64_t timeout_ns,
                       DeviceError* err) {
  using Scan = cub::BlockScan<int, kLlThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int32_t matches[kMaxMatches];
  const int64_t W = d.world_size, K = d.top_k, El = d.experts_per_rank, me = d.rank;
  const int64_t row_bytes = d.hidden * 2, cap = ll.ll_tokens;
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  // Blocks of our own experts (the only ones that wait) come last in the grid, so every sending
  // block is scheduled before any waiting one, whatever the grid's residency.
  const int64_t expert = (blockIdx.x + (me + 1) * El) % d.num_experts;
  const int64_t dst = expert / El, local = expert % El;
  const int pe = static_cast<int>(dst);

  // Each thread scans a contiguous run of the (token, k) pairs, so one block scan of the
  // per-thread counts orders the matches by (token, k).
  const int64_t pairs = tokens * K;
  const int64_t per_thread = (pairs + kLlThreads - 1) / kLlThreads;
  const int64_t first = threadIdx.x * per_thread;
  const int64_t last = first + per_thread < pairs ? first + per_thread : pairs;
  int hits = 0;
  for (int64_t i = first; i < last; ++i) {
    const int64_t id = topk_idx[i];
    hits += id == expert ? 1 : 0;
    // An id that matches no expert would be sent nowhere: the grid's first block names it.
    if (blockIdx.x == 0 && (id < -1 || id >= d.num_experts))
      report_error(err, WaitOp::kBadExpert, static_cast<int>(me), static_cast<uint64_t>(i),
                   static_cast<uint64_t>(id));
  }
  int pos, n;
  Scan(temp).ExclusiveSum(hits, pos, n);
  for (int64_t i = first; i < last && hits > 0; ++i) {
    if (topk_idx[i] != expert) continue;
    if (pos < kMaxMatches) matches[pos] = static_cast<int32_t>(i);
    ++pos;
  }
  __syncthreads();
  // A region holds `cap` rows; more (an expert repeated within a token's top-k) is an error,
  // never a silent drop.
  if (n > cap || n > kMaxMatches) {
    if (threadIdx.x == 0) report_error(err, WaitOp::kCapacity, static_cast<int>(dst), n, cap);
    n = 0;
  }

  const int64_t region = (local * W + me) * cap;
  uint8_t* rows = ll.x[b] + region * d.row_cap;
  int64_t* meta = ll.meta[b] + region;
  auto* peer_rows = static_cast<uint8_t*>(nvshmem_ptr(rows, pe));
  auto* peer_meta = static_cast<int64_t*>(nvshmem_ptr(meta, pe));
  const int lane = threadIdx.x % 32;
  for (int item = threadIdx.x / 32; item < n * kLlSegments; item += kLlWarps) {
    const int j = item / kLlSegments, seg = item % kLlSegments;
    const int64_t pair = matches[j], t = pair / K;
    const RowSegment part = row_segment(row_bytes, kLlSegments, seg);
    const uint8_t* from = x + t * row_bytes + part.offset;
    if (peer_rows != nullptr) {
      warp_copy<kLlUnroll>(peer_rows + j * d.row_cap + part.offset, from, part.bytes, lane);
      if (lane == 0 && seg == 0) peer_meta[j] = pair;
    } else {
      nvshmemx_putmem_nbi_warp(rows + j * d.row_cap + part.offset, from, part.bytes, pe);
      if (lane == 0 && seg == 0) nvshmem_int64_p(meta + j, pair, pe);
    }
  }
  nvshmem_quiet();
  __syncthreads();
  if (threadIdx.x == 0)
    nvshmemx_signal_op(ll.count[b] + local * W + me, static_cast<uint64_t>(n) + 1,
                       NVSHMEM_SIGNAL_SET, pe);

  // Our own experts: wait for every source's count, publish it, and clear the signal for the
  // next round on this buffer (no source can set it again before this round's combine).
  if (dst != me) return;
  for (int64_t s = threadIdx.x; s < W; s += blockDim.x) {
    uint64_t* signal = ll.count[b] + local * W + s;
    if (wait_at_least(signal, 1, deadline, err, WaitOp::kDispatch, static_cast<int>(s))) {
      __threadfence();
      ll.recv_count[(b * El + local) * W + s] = static_cast<int32_t>(*signal - 1);
      *signal = 0;
    } else {
      ll.recv_count[(b * El + local) * W + s] = 0;
    }
  }
}

}  // namespace

void launch_ll_dispatch(const LowLatencyView& ll, const EpDims& d, int buffer, const uint8_t* x,
                        const int64_t* topk_idx, int64_t tokens, uint64_t timeout_ns,
                        DeviceError* err, cudaStream_t stream) {
  ll_dispatch_kernel<<<static_cast<unsigned>(d.num_experts), kLlThreads, 0, stream>>>(
      ll, d, buffer, x, topk_idx, tokens, timeout_ns, err);
}

}  // namespace uniep::cuda
