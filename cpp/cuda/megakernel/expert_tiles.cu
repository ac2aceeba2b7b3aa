// expert_tiles (include/uniep/cuda/tile_gate.hpp): the local MegaKernel's counts, row ends and
// tile counters in one launch (after a memset of its sums).
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;                         // ids a thread loads, all in flight
constexpr int kBlockEntries = kThreads * kPerThread;  // ids a block counts
constexpr int kSharedExperts = 8192;                  // counted in shared memory up to here

// Each block counts its 2,048 ids in shared memory and adds its nonzero counts to `sums`; the
// last block to finish (a ticket after a fence) turns the sums into counts, row ends and tile
// bases. A first version ran one block with warp-merged atomics (__match_any_sync): 27-36 us on
// an H200 for 32,768 ids, slower than the ten launches it replaced, since one SM's match unit
// serialized every warp's step.
__global__ void __launch_bounds__(kThreads)
    expert_tiles_kernel(const int64_t* __restrict__ ids, int64_t n, int num_experts, int tile_m,
                        int* __restrict__ sums, unsigned* __restrict__ ticket,
                        int64_t* __restrict__ counts, int32_t* __restrict__ offs,
                        int32_t* __restrict__ tile_base) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ int hist[kSharedExperts];
  __shared__ typename Scan::TempStorage scan;
  __shared__ bool last;
  const int tid = static_cast<int>(threadIdx.x);
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
    for (int e = tid; e < num_experts; e += kThreads)
      if (hist[e] != 0) atomicAdd(&sums[e], hist[e]);
  }
  // The classic last-block pattern: every block's sums are visible before its ticket.
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  int rows_before = 0, tiles_before = 0;  // the same in every thread
  for (int g = 0; g < num_experts; g += kThreads) {
    const int e = g + tid;
    const int c = e < num_experts ? __ldcg(&sums[e]) : 0;
    const int tiles = c / tile_m + (c % tile_m != 0);
    int c_incl = 0, c_total = 0, t_excl = 0, t_total = 0;
    Scan(scan).InclusiveSum(c, c_incl, c_total);
    __syncthreads();
    Scan(scan).ExclusiveSum(tiles, t_excl, t_total);
    __syncthreads();
    if (e < num_experts) {
      counts[e] = c;
      offs[e] = rows_before + c_incl;
      tile_base[e] = tiles_before + t_excl;
    }
    rows_before += c_total;
    tiles_before += t_total;
  }
  if (tid == 0) tile_base[num_experts] = tiles_before;
}

}  // namespace

size_t expert_tiles_workspace_bytes(int64_t num_experts) {
  return num_experts < 1 ? 0 : static_cast<size_t>(num_experts + 1) * sizeof(int);
}

Status expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts, int tile_m,
                    int64_t* counts, int32_t* offs, int32_t* tile_base, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > (1 << 30))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("expert_tiles: num_experts must be in [1, 2^30], got ", num_experts)};
  if (entries < 0 || entries > (1ll << 31) - 1)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("expert_tiles: entries must be in [0, 2^31) (offs are int32), got ",
                            entries)};
  if (tile_m < 1 || tile_m > (1 << 20))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("expert_tiles: tile_m must be in [1, 2^20], got ", tile_m)};
  if ((entries > 0 && topk_idx == nullptr) || counts == nullptr || offs == nullptr ||
      tile_base == nullptr || workspace == nullptr)
    return {StatusCode::kInvalidArgument,
            "expert_tiles: topk_idx, counts, offs, tile_base and workspace must be device "
            "pointers"};
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
      reinterpret_cast<unsigned*>(sums + num_experts), counts, offs, tile_base);
  return launch_status("expert_tiles");
}

}  // namespace uniep::cuda
