// Grouped-GEMM rows of the local experts: each expert's rows are the receive slots that chose it,
// in slot order (= (source rank, source token) order), one row per matching top-k entry. Each row
// also records where its output goes back to: slot (token, k) on its source rank.
#include <cub/block/block_scan.cuh>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kUnroll = 4;  // expert ids of a slot loaded before any is compared

// One block per local expert, kThreads consecutive slots per step (coalesced metadata reads; a
// contiguous run of slots per thread made each load touch its own cache line, and the El blocks
// all read the whole metadata, so that was L2-bound), a block scan per step for the order.
__global__ void __launch_bounds__(kThreads)
    expert_rows_kernel(SymmetricView sym, EpDims d, PlanCounts plan, int64_t* row_slot,
                       int64_t* row_target) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t K = d.top_k, W = d.world_size, meta_len = 1 + K;
  const int64_t expert = blockIdx.x, global = d.rank * d.experts_per_rank + expert;
  const int64_t N = plan.recv_offsets[W];
  int64_t row = plan.expert_offsets[expert];
  for (int64_t s0 = 0; s0 < N; s0 += kThreads) {
    const int64_t slot = s0 + threadIdx.x;
    const int64_t* ids = sym.recv_meta + slot * meta_len + 1;
    int matches = 0;
    if (slot < N) {
      for (int64_t k0 = 0; k0 < K; k0 += kUnroll) {
        int64_t v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) v[u] = k0 + u < K ? ids[k0 + u] : -1;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) matches += v[u] == global ? 1 : 0;
      }
    }
    int prefix, total;
    Scan(temp).ExclusiveSum(matches, prefix, total);
    if (matches > 0) {
      const int64_t src = source_rank_of(plan, W, slot);
      int64_t r = row + prefix;
      for (int64_t k = 0; k < K; ++k) {
        if (ids[k] != global) continue;
        row_slot[r] = slot;
        row_target[r] = src * (d.max_tokens * K) + ids[-1] * K + k;
        ++r;
      }
    }
    row += total;
    __syncthreads();  // the scan's storage is reused by the next step
  }
}

}  // namespace

void launch_expert_rows(const SymmetricView& sym, const EpDims& d, PlanCounts plan,
                        int64_t* row_slot, int64_t* row_target, cudaStream_t stream) {
  expert_rows_kernel<<<static_cast<unsigned>(d.experts_per_rank), kThreads, 0, stream>>>(
      sym, d, plan, row_slot, row_target);
}

}  // namespace uniep::cuda
