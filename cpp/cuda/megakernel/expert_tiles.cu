// expert_tiles (include/uniep/cuda/tile_gate.hpp): the local MegaKernel's counts, row ends and
// tile counters in one launch (after a memset of its sums).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/local_plan.cuh"
#include "uniep/cuda/send_rows.hpp"
#include "uniep/cuda/tile_gate.hpp"
#include "uniep/send_rows_error.hpp"

namespace uniep::cuda {
namespace {

using local_plan::kBlockEntries;
using local_plan::kLocalExperts;
using local_plan::kOneBlockEntries;
using local_plan::kPerThread;
using local_plan::kThreads;
using local_plan::kWarpEntries;
using local_plan::kWarps;
using local_plan::WarpEntries;
constexpr int kSharedExperts = 8192;  // counted in shared memory up to here

// Each block counts its 2,048 ids in shared memory and adds its nonzero counts to `sums`; the
// last block to finish (a ticket after a fence) turns the sums into counts, row ends and tile
// bases. A first version ran one block with warp-merged atomics (__match_any_sync): 27-36 us on
// an H200 for 32,768 ids, slower than the ten launches it replaced, since one SM's match unit
// serialized every warp's step.
__global__ void __launch_bounds__(kThreads)
    expert_tiles_kernel(const int64_t* __restrict__ ids, int64_t n, int num_experts, int tile_m,
                        int* __restrict__ sums, unsigned* __restrict__ ticket,
                        int64_t* __restrict__ counts, int32_t* __restrict__ offs,
                        int32_t* __restrict__ tile_base, int* __restrict__ block_rows,
                        unsigned long long* __restrict__ zero_error) {
  __shared__ int hist[kSharedExperts];
  __shared__ local_plan::ScanStorage scan;
  __shared__ bool last;
  const int tid = static_cast<int>(threadIdx.x);
  // The local plan's error word, which only the launch after this one writes: zeroed here
  // rather than by a fill of its own (one launch fewer before the MegaKernel).
  if (zero_error != nullptr && blockIdx.x == 0 && tid == 0) *zero_error = 0;
  const bool shared = num_experts <= kSharedExperts;
  if (shared) {
    for (int e = tid; e < num_experts; e += kThreads) hist[e] = 0;
    __syncthreads();
  }
  const int64_t first = int64_t{blockIdx.x} * kBlockEntries + tid;
  int64_t id[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = first + j * kThreads;
    id[j] = i < n ? ids[i] : -1;
  }
#pragma unroll
  for (int j = 0; j < kPerThread; ++j)
    if (id[j] >= 0 && id[j] < num_experts) atomicAdd(shared ? &hist[id[j]] : &sums[id[j]], 1);
  if (shared) {
    __syncthreads();
    int* mine = block_rows != nullptr ? block_rows + int64_t{blockIdx.x} * num_experts : nullptr;
    for (int e = tid; e < num_experts; e += kThreads) {
      if (hist[e] != 0) atomicAdd(&sums[e], hist[e]);
      if (mine != nullptr) mine[e] = hist[e];
    }
  }
  // The classic last-block pattern: every block's sums are visible before its ticket.
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int tiles = local_plan::scan_experts(
      num_experts, tile_m, scan, [&](int e) { return __ldcg(&sums[e]); },
      [&](int e, int c, int rows_end, int first_tile) {
        counts[e] = c;
        offs[e] = rows_end;
        tile_base[e] = first_tile;
      });
  if (tid == 0) tile_base[num_experts] = tiles;
  if (block_rows == nullptr) return;
  // The local plan's block bases: block_rows[b][e] becomes the GEMM row of the first of block
  // b's entries routed to e (the rows of e's entries in the blocks before it, after e's start).
  // The offs and counts this block wrote above are visible to its threads after the barrier.
  __syncthreads();
  for (int e = tid; e < num_experts; e += kThreads) {
    int row = offs[e] - static_cast<int>(counts[e]);
    for (unsigned b = 0; b < gridDim.x; ++b) {
      int* cell = block_rows + int64_t{b} * num_experts + e;
      const int c = __ldcg(cell);
      *cell = row;
      row += c;
    }
  }
}

// Block b's entries of the local plan, after expert_tiles_kernel gave each block its first row
// per expert.
__global__ void __launch_bounds__(kThreads)
    local_rows_kernel(const int64_t* __restrict__ ids, int64_t n, int num_experts, int tile_m,
                      const int64_t* __restrict__ counts, const int32_t* __restrict__ offs,
                      const int32_t* __restrict__ tile_base, const int* __restrict__ block_rows,
                      int64_t* __restrict__ dest_rank, int64_t* __restrict__ gemm_row,
                      int64_t* __restrict__ counter, unsigned long long* __restrict__ error) {
  __shared__ int table[kWarps][kLocalExperts];
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const int64_t seg = int64_t{blockIdx.x} * kBlockEntries + int64_t{warp} * kWarpEntries;
  WarpEntries<> mine = local_plan::load_warp_entries(ids, n, num_experts, seg, kWarpEntries, lane);
  for (int e = tid; e < num_experts; e += kThreads)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) table[w][e] = 0;
  __syncthreads();
  local_plan::count_warp_entries(mine, lane, table[warp]);
  __syncthreads();
  // Each warp's first row per expert: the block's base, then the warps before it.
  const int* base = block_rows + int64_t{blockIdx.x} * num_experts;
  for (int e = tid; e < num_experts; e += kThreads) {
    int row = base[e];
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int c = table[w][e];
      table[w][e] = row;
      row += c;
    }
  }
  __syncthreads();
  local_plan::place_warp_entries(
      mine, n, num_experts, lane, table[warp],
      [&](int e, int row) {
        return tile_base[e] + (row - (offs[e] - static_cast<int>(counts[e]))) / tile_m;
      },
      dest_rank, gemm_row, counter, error);
}

// The whole local plan of up to one block's entries in one launch and no memset
// (local_plan::plan_one_block). Replayed alone in a CUDA graph on one H200 (2026-12-02) the
// memset and two launches above took 17 us of a 65 us 1-token step, this launch 10.5 us.
__global__ void __launch_bounds__(kThreads)
    local_plan_small_kernel(const int64_t* __restrict__ ids, int64_t n, int num_experts, int tile_m,
                            int64_t* __restrict__ counts, int32_t* __restrict__ offs,
                            int32_t* __restrict__ tile_base, int64_t* __restrict__ dest_rank,
                            int64_t* __restrict__ gemm_row, int64_t* __restrict__ counter,
                            unsigned long long* __restrict__ error) {
  local_plan::plan_one_block(
      ids, n, num_experts, tile_m, counts, offs, tile_base, dest_rank, gemm_row, counter, error,
      // A kernel launched behind this one as a programmatic dependent launch may start now; it
      // waits for this kernel's end before reading.
      [] { allow_next_grid(); }, [](int, int, int) {});
}

// The argument checks expert_tiles and plan_local_rows_async share; `what` names the call.
Status check_expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts, int tile_m,
                          const void* counts, const void* offs, const void* tile_base,
                          const void* workspace, const char* what) {
  if (num_experts < 1 || num_experts > (1 << 30))
    return {StatusCode::kInvalidArgument,
            detail::str_cat(what, ": num_experts must be in [1, 2^30], got ", num_experts)};
  if (entries < 0 || entries > (1ll << 31) - 1)
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat(what, ": entries must be in [0, 2^31) (offs are int32), got ", entries)};
  if (tile_m < 1 || tile_m > (1 << 20))
    return {StatusCode::kInvalidArgument,
            detail::str_cat(what, ": tile_m must be in [1, 2^20], got ", tile_m)};
  if ((entries > 0 && topk_idx == nullptr) || counts == nullptr || offs == nullptr ||
      tile_base == nullptr || workspace == nullptr)
    return {StatusCode::kInvalidArgument,
            detail::str_cat(what,
                            ": topk_idx, counts, offs, tile_base and workspace must be "
                            "device pointers")};
  return Status::Ok();
}

}  // namespace

size_t expert_tiles_workspace_bytes(int64_t num_experts) {
  return num_experts < 1 ? 0 : static_cast<size_t>(num_experts + 1) * sizeof(int);
}

Status expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts, int tile_m,
                    int64_t* counts, int32_t* offs, int32_t* tile_base, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  if (Status st = check_expert_tiles(topk_idx, entries, num_experts, tile_m, counts, offs,
                                     tile_base, workspace, "expert_tiles");
      !st.ok())
    return st;
  const size_t need = expert_tiles_workspace_bytes(num_experts);
  if (workspace_bytes < need)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("expert_tiles: workspace_bytes must be >= ", need, ", got ",
                            workspace_bytes)};
  auto* sums = static_cast<int*>(workspace);
  if (const cudaError_t e = cudaMemsetAsync(sums, 0, need, stream); e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("expert_tiles: zeroing the workspace failed: ", cudaGetErrorString(e))};
  const int64_t blocks = std::max<int64_t>(1, (entries + kBlockEntries - 1) / kBlockEntries);
  expert_tiles_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      topk_idx, entries, static_cast<int>(num_experts), tile_m, sums,
      reinterpret_cast<unsigned*>(sums + num_experts), counts, offs, tile_base, nullptr, nullptr);
  return launch_status("expert_tiles");
}

size_t local_plan_workspace_bytes(int64_t entries, int64_t num_experts) {
  if (num_experts < 1 || entries < 0) return 0;
  const int64_t blocks = std::max<int64_t>(1, (entries + kBlockEntries - 1) / kBlockEntries);
  size_t bytes = expert_tiles_workspace_bytes(num_experts);
  if (num_experts <= kLocalExperts)
    bytes += static_cast<size_t>(blocks * num_experts) * sizeof(int);
  return bytes;
}

Status plan_local_rows_async(const LocalPlanArgs& a, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  const int64_t entries = a.tokens * a.top_k;
  if (a.tokens < 0 || a.top_k < 1 || a.top_k > 32)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("plan_local_rows_async: tokens must be >= 0 and top_k in [1, 32], got ",
                            a.tokens, " and ", a.top_k)};
  // Zero tokens give empty per-entry arrays, which torch hands over as null.
  if (a.error == nullptr ||
      (entries > 0 && (a.dest_rank == nullptr || a.gemm_row == nullptr || a.counter == nullptr)))
    return {StatusCode::kInvalidArgument,
            "plan_local_rows_async: dest_rank, gemm_row and counter (when tokens > 0) and error "
            "must be device pointers"};
  const size_t need = local_plan_workspace_bytes(entries, a.num_experts);
  if (workspace_bytes < need)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("plan_local_rows_async: workspace_bytes must be >= ", need, ", got ",
                            workspace_bytes)};
  const int64_t E = a.num_experts;
  if (E > kLocalExperts) {
    // Past the per-warp table: the counts, then the cross-rank plan kernel at world 1.
    if (const cudaError_t e = cudaMemsetAsync(a.error, 0, sizeof(*a.error), stream);
        e != cudaSuccess)
      return {
          StatusCode::kInternal,
          detail::str_cat("plan_local_rows_async: zeroing error failed: ", cudaGetErrorString(e))};
    Status st = expert_tiles(a.topk_idx, entries, E, a.tile_m, a.counts, a.offs, a.tile_base,
                             workspace, workspace_bytes, stream);
    if (!st.ok()) return st;
    SenderRowsPlanArgs p;
    p.topk_idx = a.topk_idx;
    p.tokens = a.tokens;
    p.top_k = a.top_k;
    p.counts = a.counts;
    p.counts_ld = E;
    p.num_experts = E;
    p.tile_m = a.tile_m;
    p.dest_rank = a.dest_rank;
    p.gemm_row = a.gemm_row;
    p.counter = a.counter;
    p.error = a.error;
    return plan_sender_rows_async(p, stream);
  }
  if (Status st = check_expert_tiles(a.topk_idx, entries, E, a.tile_m, a.counts, a.offs,
                                     a.tile_base, workspace, "plan_local_rows_async");
      !st.ok())
    return st;
  if (entries <= kOneBlockEntries) {
    local_plan_small_kernel<<<1, kThreads, 0, stream>>>(
        a.topk_idx, entries, static_cast<int>(E), a.tile_m, a.counts, a.offs, a.tile_base,
        a.dest_rank, a.gemm_row, a.counter, a.error);
    return launch_status("plan_local_rows_async (one block)");
  }
  auto* sums = static_cast<int*>(workspace);
  const size_t zeroed = expert_tiles_workspace_bytes(E);
  if (const cudaError_t e = cudaMemsetAsync(sums, 0, zeroed, stream); e != cudaSuccess)
    return {StatusCode::kInternal, detail::str_cat("plan_local_rows_async: zeroing the workspace "
                                                   "failed: ",
                                                   cudaGetErrorString(e))};
  int* block_rows = sums + E + 1;
  const int64_t blocks = std::max<int64_t>(1, (entries + kBlockEntries - 1) / kBlockEntries);
  expert_tiles_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      a.topk_idx, entries, static_cast<int>(E), a.tile_m, sums,
      reinterpret_cast<unsigned*>(sums + E), a.counts, a.offs, a.tile_base, block_rows, a.error);
  if (Status st = launch_status("plan_local_rows_async (counts)"); !st.ok()) return st;
  local_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      a.topk_idx, entries, static_cast<int>(E), a.tile_m, a.counts, a.offs, a.tile_base, block_rows,
      a.dest_rank, a.gemm_row, a.counter, a.error);
  return launch_status("plan_local_rows_async (rows)");
}

}  // namespace uniep::cuda
