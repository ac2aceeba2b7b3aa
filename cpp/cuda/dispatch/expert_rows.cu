// Grouped-GEMM rows of the local experts: each expert's rows are the receive slots that chose it,
// in slot order (= (source rank, source token) order), one row per matching top-k entry. Each row
// also records where its output goes back to: slot (token, k) on its source rank.
#include <cub/block/block_scan.cuh>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;

// One block per local expert. Each thread takes a contiguous run of slots, so a single block
// scan of the per-thread match counts orders the rows by (slot, k): one scan per call instead of
// one per 512 slots (the kernel was a chain of scan latencies).
__global__ void __launch_bounds__(kThreads)
    expert_rows_kernel(SymmetricView sym, EpDims d, PlanCounts plan, int64_t* row_slot,
                       int64_t* row_target) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t K = d.top_k, W = d.world_size, meta_len = 1 + K;
  const int64_t expert = blockIdx.x, global = d.rank * d.experts_per_rank + expert;
  const int64_t N = plan.recv_offsets[W];
  const int64_t per_thread = (N + kThreads - 1) / kThreads;
  const int64_t first = threadIdx.x * per_thread;
  const int64_t last = first + per_thread < N ? first + per_thread : N;
  int64_t matches = 0;
  for (int64_t slot = first; slot < last; ++slot) {
    const int64_t* meta = sym.recv_meta + slot * meta_len;
    for (int64_t k = 0; k < K; ++k) matches += meta[1 + k] == global ? 1 : 0;
  }
  int64_t prefix, total;
  Scan(temp).ExclusiveSum(matches, prefix, total);
  if (matches == 0) return;
  int64_t r = plan.expert_offsets[expert] + prefix;
  int64_t src = 0;
  for (int64_t slot = first; slot < last; ++slot) {
    const int64_t* meta = sym.recv_meta + slot * meta_len;
    while (slot >= plan.recv_offsets[src + 1]) ++src;
    for (int64_t k = 0; k < K; ++k) {
      if (meta[1 + k] != global) continue;
      row_slot[r] = slot;
      row_target[r] = src * (d.max_tokens * K) + meta[0] * K + k;
      ++r;
    }
  }
}

}  // namespace

void launch_expert_rows(const SymmetricView& sym, const EpDims& d, PlanCounts plan,
                        int64_t* row_slot, int64_t* row_target, cudaStream_t stream) {
  expert_rows_kernel<<<static_cast<unsigned>(d.experts_per_rank), kThreads, 0, stream>>>(
      sym, d, plan, row_slot, row_target);
}

}  // namespace uniep::cuda
