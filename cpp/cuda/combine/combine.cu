// Combine: each expert output row goes to slot (token, k) of its source rank; the source then
// reduces over k in ascending order in fp32 (common/combine_reduce.cuh, shared with the
// low-latency combine and bit-identical to the CPU executor). A row whose source is this rank
// is not copied: its slot's entry in the row index names it, and the reduction reads it from y
// (the same bytes; at world 1 that is every row, a whole copy of the expert outputs saved).
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common/combine_reduce.cuh"
#include "cuda/common/signal_wait.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__global__ void __launch_bounds__(kThreads, 1)
    combine_send_kernel(SymmetricView sym, EpDims d, CombineArgs a, SelfRowIndex self) {
  const int64_t W = d.world_size, K = d.top_k, me = d.rank, H = d.hidden;
  const int64_t row_bytes = H * 2, per_rank = d.max_tokens * K;
  const uint64_t deadline = global_timer_ns() + a.timeout_ns;
  const int lane = threadIdx.x % 32;
  unsigned long long* sent = block_send_counts(W);

  // A warp takes 32 rows at a time: each lane records its row if the row stays on this rank
  // (one atomic, no copy: at world 1 every row), then the whole warp copies the others to their
  // peers one by one. With a warp per row the kernel took 24 us a call on DeepSeek-V3's EP8-rank
  // load at world 1 (32768 own rows; one H100, 2026-11-28, commit c7c5471).
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t base = warp * 32; base < a.rows; base += num_warps * 32) {
    const int64_t r = base + lane;
    const int64_t target = r < a.rows ? a.row_target[r] : -1;
    const int pe = static_cast<int>(target / per_rank);
    const bool own = r < a.rows && pe == me && self.row_of_slot != nullptr;
    if (own) {
      const int64_t slot = target % per_rank;
      const auto old =
          atomicExch(reinterpret_cast<unsigned long long*>(self.row_of_slot + slot),
                     static_cast<unsigned long long>(self.epoch) << 32 | static_cast<uint32_t>(r));
      // Two rows for one slot: the plan is broken (the copy path would keep the later one).
      if (old >> 32 == self.epoch)
        report_error(a.err, WaitOp::kCombineTarget, static_cast<int>(me), r, target);
    }
    const unsigned own_lanes = __ballot_sync(0xffffffffu, own);
    if (lane == 0 && own_lanes != 0)
      atomicAdd(&sent[me], static_cast<unsigned long long>(__popc(own_lanes)));
    for (unsigned peers = __ballot_sync(0xffffffffu, r < a.rows && !own); peers != 0;
         peers &= peers - 1) {
      const int j = __ffs(peers) - 1;
      const int64_t row = base + j;
      const int64_t row_target = __shfl_sync(0xffffffffu, target, j);
      const int row_pe = static_cast<int>(row_target / per_rank);
      uint8_t* slot = sym.combine + (row_target % per_rank) * row_bytes;
      auto* peer_slot = static_cast<uint8_t*>(nvshmem_ptr(slot, row_pe));
      if (peer_slot != nullptr) {
        warp_copy<8>(peer_slot, a.y + row * row_bytes, row_bytes, lane);
      } else {
        nvshmemx_putmem_nbi_warp(slot, a.y + row * row_bytes, row_bytes, row_pe);
      }
      if (lane == 0) atomicAdd(&sent[row_pe], 1ull);
    }
  }
  // Waited for here, so the reduction kernel that follows on the stream sees every row.
  const auto owed = [&](int64_t s) { return a.plan.rows_back[s]; };
  signal_then_wait(sym.signals + kCombineSignal * W, sent, sym.tally + kCombineSignal, W, me, owed,
                   deadline, a.err, WaitOp::kCombine);
}

__global__ void combine_reduce_kernel(SymmetricView sym, EpDims d, CombineArgs a,
                                      SelfRowIndex self) {
  combine_reduce_bf16(sym.combine, a.topk_idx, a.topk_weights, a.tokens, d.top_k, d.hidden, a.out,
                      SelfRows{self.row_of_slot, self.epoch, a.y});
}

}  // namespace

void launch_combine(const SymmetricView& sym, const EpDims& d, const CombineArgs& a,
                    const SelfRowIndex& self, int blocks, int reduce_blocks, cudaStream_t stream) {
  combine_send_kernel<<<blocks, kThreads, 0, stream>>>(sym, d, a, self);
  if (a.tokens > 0) combine_reduce_kernel<<<reduce_blocks, 256, 0, stream>>>(sym, d, a, self);
}

}  // namespace uniep::cuda
