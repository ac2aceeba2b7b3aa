// Grouped-GEMM rows of the local experts: each expert's rows are the receive slots that chose it,
// in slot order (= (source rank, source token) order), one row per matching top-k entry. Each row
// also records where its output goes back to: slot (token, k) on its source rank.
#include <cub/block/block_scan.cuh>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 8;  // metadata words in flight per thread

// One block per local expert. Each thread takes a contiguous run of slots, so a single block
// scan of the per-thread match counts orders the rows by (slot, k). The run's metadata is one
// contiguous array ([slot][source token, K expert ids]) read kUnroll words at a time: a loop
// of dependent loads per (slot, k) made the kernel a chain of L2 latencies.
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
  const int64_t* run = sym.recv_meta + first * meta_len;
  // 32-bit positions within the run: 64-bit division is a long software routine.
  const int len = static_cast<int>(meta_len);
  const int words = first < last ? static_cast<int>((last - first) * meta_len) : 0;
  // Word i of the run is an expert id unless it starts a slot (the source token).
  auto matches_at = [&](int i, int64_t v) { return i % len != 0 && v == global; };

  int64_t matches = 0;
  for (int i0 = 0; i0 < words; i0 += kUnroll) {
    int64_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = i0 + u < words ? run[i0 + u] : -1;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) matches += matches_at(i0 + u, v[u]) ? 1 : 0;
  }
  int64_t prefix, total;
  Scan(temp).ExclusiveSum(matches, prefix, total);
  if (matches == 0) return;
  int64_t r = plan.expert_offsets[expert] + prefix;
  int64_t src = 0;
  for (int i0 = 0; i0 < words; i0 += kUnroll) {
    int64_t v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = i0 + u < words ? run[i0 + u] : -1;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (!matches_at(i0 + u, v[u])) continue;
      const int64_t slot = first + (i0 + u) / len, k = (i0 + u) % len - 1;
      while (slot >= plan.recv_offsets[src + 1]) ++src;
      row_slot[r] = slot;
      row_target[r] = src * (d.max_tokens * K) + sym.recv_meta[slot * meta_len] * K + k;
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
