// Low-latency combine: rows of the dispatch's regions go back to slot (token, k) of their source
// (the region's metadata names it); each region's block then sets its own word on the source, and
// the source waits for every region's word and reduces over k with the high-throughput combine's
// reduction (common/combine_reduce.cuh), so both give the same bits.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common/combine_reduce.cuh"
#include "cuda/common/ll_launch.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

// One block per (local expert, source) region.
__global__ void __launch_bounds__(kLlThreads, kLlMinBlocksPerSm)
    ll_combine_send_kernel(LowLatencyView ll, EpDims d, int b, const uint8_t* y,
                           uint64_t timeout_ns, DeviceError* err) {
  const int64_t W = d.world_size, El = d.experts_per_rank, me = d.rank;
  const int64_t row_bytes = d.hidden * 2, cap = ll.ll_tokens;
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  const int64_t local = blockIdx.x / W, src = blockIdx.x % W;
  const int pe = static_cast<int>(src);
  const int n = ll.recv_count[(b * El + local) * W + src];
  const int64_t region = (local * W + src) * cap;
  const int lane = threadIdx.x % 32;
  for (int item = threadIdx.x / 32; item < n * kLlSegments; item += kLlWarps) {
    const int j = item / kLlSegments;
    const RowSegment part = row_segment(row_bytes, kLlSegments, item % kLlSegments);
    const int64_t slot = ll.meta[b][region + j];
    uint8_t* dst = ll.combine[b] + slot * row_bytes + part.offset;
    const uint8_t* row = y + (region + j) * row_bytes + part.offset;
    auto* peer = static_cast<uint8_t*>(nvshmem_ptr(dst, pe));
    if (peer != nullptr) {
      warp_copy<kLlUnroll>(peer, row, part.bytes, lane);
    } else {
      nvshmemx_putmem_nbi_warp(dst, row, part.bytes, pe);
    }
  }
  nvshmem_quiet();
  __syncthreads();
  // One word per region, set (rows + 1, so that an empty region answers too): a single word per
  // rank that every region's block added to made ~E/W remote atomics on one address per rank,
  // which the target serialises.
  if (threadIdx.x == 0)
    nvshmemx_signal_op(ll.back[b] + local * W + me, static_cast<uint64_t>(n) + 1,
                       NVSHMEM_SIGNAL_SET, pe);

  // The last block waits for every region's word, then clears them for the next round on this
  // buffer. Last, so that it never holds an SM that a sending block is queued for.
  if (blockIdx.x != gridDim.x - 1) return;
  for (int64_t i = threadIdx.x; i < El * W; i += blockDim.x) {
    if (wait_at_least(ll.back[b] + i, 1, deadline, err, WaitOp::kCombine, static_cast<int>(i % W)))
      ll.back[b][i] = 0;
  }
}

__global__ void ll_combine_reduce_kernel(LowLatencyView ll, EpDims d, int b,
                                         const int64_t* topk_idx, const float* topk_weights,
                                         int64_t tokens, uint8_t* out) {
  combine_reduce_bf16(ll.combine[b], topk_idx, topk_weights, tokens, d.top_k, d.hidden, out);
}

}  // namespace

void launch_ll_combine(const LowLatencyView& ll, const EpDims& d, int buffer, const uint8_t* y,
                       const int64_t* topk_idx, const float* topk_weights, int64_t tokens,
                       uint8_t* out, int reduce_blocks, uint64_t timeout_ns, DeviceError* err,
                       cudaStream_t stream) {
  const unsigned regions = static_cast<unsigned>(d.experts_per_rank * d.world_size);
  ll_combine_send_kernel<<<regions, kLlThreads, 0, stream>>>(ll, d, buffer, y, timeout_ns, err);
  if (tokens > 0)
    ll_combine_reduce_kernel<<<reduce_blocks, 256, 0, stream>>>(ll, d, buffer, topk_idx,
                                                                topk_weights, tokens, out);
}

}  // namespace uniep::cuda
