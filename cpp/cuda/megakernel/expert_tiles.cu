// expert_tiles (include/uniep/cuda/tile_gate.hpp): the local MegaKernel's counts, row ends and
// tile counters in one launch.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kChunk = 8192;  // experts one pass counts in shared memory (32 KB)
constexpr int kUnroll = 8;    // ids a thread loads before counting them (all in flight)

// One block: the counts of 32,768 entries are a few microseconds of shared-memory atomics, less
// than the launches of a multi-block reduction would cost. Past kChunk experts the block takes
// one pass over the ids per kChunk experts.
__global__ void __launch_bounds__(kThreads)
    expert_tiles_kernel(const int64_t* __restrict__ ids, int n, int num_experts, int tile_m,
                        int64_t* __restrict__ counts, int32_t* __restrict__ offs,
                        int32_t* __restrict__ tile_base) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ int hist[kChunk];
  __shared__ typename Scan::TempStorage scan;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32;
  int rows_before = 0, tiles_before = 0;  // the same in every thread
  for (int first = 0; first < num_experts; first += kChunk) {
    const int width = min(kChunk, num_experts - first);
    for (int e = tid; e < width; e += kThreads) hist[e] = 0;
    __syncthreads();
    // Every lane runs every trip (the bounds are the block's), so the warp can merge equal ids
    // into one atomic: a routing that sends every entry to one expert does not serialize 32x.
    for (int64_t base = 0; base < n; base += kThreads * kUnroll) {
      int64_t id[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int64_t i = base + j * kThreads + tid;
        id[j] = i < n ? ids[i] : -1;
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int key =
            id[j] >= first && id[j] < first + width ? static_cast<int>(id[j] - first) : -1;
        const unsigned peers = __match_any_sync(0xffffffffu, key);
        if (key >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[key], __popc(peers));
      }
    }
    __syncthreads();
    for (int g = 0; g < width; g += kThreads) {
      const int e = g + tid;
      const int c = e < width ? hist[e] : 0;
      const int tiles = c / tile_m + (c % tile_m != 0);
      int c_incl = 0, c_total = 0, t_excl = 0, t_total = 0;
      Scan(scan).InclusiveSum(c, c_incl, c_total);
      __syncthreads();
      Scan(scan).ExclusiveSum(tiles, t_excl, t_total);
      __syncthreads();
      if (e < width) {
        counts[first + e] = c;
        offs[first + e] = rows_before + c_incl;
        tile_base[first + e] = tiles_before + t_excl;
      }
      rows_before += c_total;
      tiles_before += t_total;
    }
    __syncthreads();  // hist is the next pass's
  }
  if (tid == 0) tile_base[num_experts] = tiles_before;
}

}  // namespace

Status expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts, int tile_m,
                    int64_t* counts, int32_t* offs, int32_t* tile_base, cudaStream_t stream) {
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
      tile_base == nullptr)
    return {StatusCode::kInvalidArgument,
            "expert_tiles: topk_idx, counts, offs and tile_base must be device pointers"};
  expert_tiles_kernel<<<1, kThreads, 0, stream>>>(topk_idx, static_cast<int>(entries),
                                                  static_cast<int>(num_experts), tile_m, counts,
                                                  offs, tile_base);
  return launch_status("expert_tiles");
}

}  // namespace uniep::cuda
