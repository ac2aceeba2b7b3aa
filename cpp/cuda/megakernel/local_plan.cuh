// The local plan of the routing at world 1 (plan_local_rows_async,
// include/uniep/cuda/send_rows.hpp): the counting sort that gives each (token, k) entry its GEMM
// row and tile counter, shared by expert_tiles.cu's kernels and the MegaKernel's planning launch
// (sm90_forward.cu), which makes the same plan in the launch that readies its problem arrays.
#pragma once

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "uniep/send_rows_error.hpp"

namespace uniep::cuda::local_plan {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;                         // ids a thread loads, all in flight
constexpr int kBlockEntries = kThreads * kPerThread;  // ids a block of the multi-block plan counts
// Ids the one-block plan (plan_one_block) takes: a decode batch of up to 512 tokens of top-8 in
// one launch, where the multi-block plan's memset and two launches took 20-26 us of such a step
// (one H100, 2026-12-05). Its warps walk twice as many steps as a block of the multi-block plan.
constexpr int kOneBlockEntries = 2 * kBlockEntries;

// The local plan's counting sort: each warp walks a segment of consecutive entries in (token, k)
// order (256 in the multi-block plan, the batch split evenly over the warps in the one-block
// one), ranking equal ids by __match_any_sync, after a first walk that counts them per warp; so
// the i-th entry routed to e gets e's i-th row, as plan_sender_rows (cpp/core/experts.cpp) gives
// it. The expert bound keeps the per-warp table in shared memory (8 x 1024 ints).
constexpr int kLocalExperts = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kWarpEntries = kBlockEntries / kWarps;
constexpr int kWarpSteps = kWarpEntries / 32;
constexpr int kOneBlockWarpSteps = kOneBlockEntries / kWarps / 32;
using ScanStorage = cub::BlockScan<int, kThreads>::TempStorage;

// One warp's segment [seg, seg + 32 x steps) of the entries, read once, every lane's loads in
// flight together, and kept in registers for both passes. Why not read in each step: the steps
// are a dependent chain (each ranks against the table the step before updated), so with the
// read inside it a 512-entry batch, whose two warps took 8 steps each, paid 16 global-memory
// latencies, and the plan took 8 us against 2.6 us for one token (one H200, 2026-12-03,
// ef256e9).
template <int Steps = kWarpSteps>
struct WarpEntries {
  static constexpr int kSteps = Steps;
  int64_t seg = 0;
  int steps = 0;               // the same in every lane
  int64_t id[Steps] = {};      // this lane's entry of each step, or -1 past n
  int key[Steps] = {};         // its expert, or -1 for no entry, a negative id or one past E
  unsigned peers[Steps] = {};  // the lanes of the step with the same key (count_warp_entries)
};

// Entries [seg, seg + seg_len) (seg_len a multiple of 32, at most 32 x Steps), none past n.
template <int Steps = kWarpSteps>
__device__ __forceinline__ WarpEntries<Steps> load_warp_entries(const int64_t* __restrict__ ids,
                                                                int64_t n, int num_experts,
                                                                int64_t seg, int seg_len,
                                                                int lane) {
  WarpEntries<Steps> w;
  w.seg = seg;
  const int64_t left = (n - seg + 31) / 32;
  w.steps = seg >= n ? 0 : left < seg_len / 32 ? static_cast<int>(left) : seg_len / 32;
#pragma unroll
  for (int s = 0; s < Steps; ++s) {
    const int64_t i = seg + s * 32 + lane;
    w.id[s] = s < w.steps && i < n ? ids[i] : -1;
    w.key[s] = w.id[s] >= 0 && w.id[s] < num_experts ? static_cast<int>(w.id[s]) : -1;
  }
  return w;
}

// The counting sort's first pass over one warp's entries: `table[e]` (the warp's own, zeroed)
// gains the entries routed to e, one leader per id and step (no atomics). Keeps each step's
// peers for the second pass: __match_any_sync is the slowest instruction of a step, and the
// 4,096-entry plan's warps walk 16 steps in each pass.
template <class Entries>
__device__ __forceinline__ void count_warp_entries(Entries& w, int lane, int* table) {
#pragma unroll
  for (int s = 0; s < Entries::kSteps; ++s) {
    if (s >= w.steps) break;
    const int key = w.key[s];
    const unsigned peers = __match_any_sync(0xffffffffu, key);
    w.peers[s] = peers;
    if (key >= 0 && lane == __ffs(peers) - 1) table[key] += __popc(peers);
  }
}

// The second pass, after count_warp_entries on the same entries: with `table[e]` the warp's
// first row of e, each entry gets its row in entry order (equal ids ranked by the first pass's
// peers), and `counter_of(e, row)` its tile counter; an
// unused entry gets -1 everywhere, and an id past the experts is reported in `error`. dest_rank
// may be null (the MegaKernel at world 1 does not read it).
template <class Entries, class CounterOf>
__device__ __forceinline__ void place_warp_entries(const Entries& w, int64_t n, int num_experts,
                                                   int lane, int* table, CounterOf counter_of,
                                                   int64_t* __restrict__ dest_rank,
                                                   int64_t* __restrict__ gemm_row,
                                                   int64_t* __restrict__ counter,
                                                   unsigned long long* __restrict__ error) {
  const uint32_t below = (1u << lane) - 1u;
#pragma unroll
  for (int s = 0; s < Entries::kSteps; ++s) {
    if (s >= w.steps) break;
    const int64_t i = w.seg + s * 32 + lane;
    const int key = w.key[s];
    const unsigned peers = w.peers[s];
    const int first = key >= 0 ? table[key] : 0;
    __syncwarp();
    if (key >= 0 && lane == __ffs(peers) - 1) table[key] = first + __popc(peers);
    __syncwarp();
    if (i >= n) continue;
    if (key < 0) {
      if (dest_rank != nullptr) dest_rank[i] = -1;
      gemm_row[i] = counter[i] = -1;
      if (w.id[s] >= num_experts || w.id[s] < -1)
        atomicCAS(error, 0ull, static_cast<unsigned long long>(send_error_word(kSendBadExpert, i)));
      continue;
    }
    const int row = first + __popc(peers & below);
    if (dest_rank != nullptr) dest_rank[i] = 0;
    gemm_row[i] = row;
    counter[i] = counter_of(key, row);
  }
}

// The experts' row and tile prefix sums, kThreads experts a round: `count_of(e)` gives e's
// rows (called for e < num_experts only), and `on_expert(e, c, rows_end, first_tile)` runs once
// per expert in the thread of e, with e's rows, its row end (offs) and its first tile counter.
// Every thread of the block calls it; it returns the tiles of all experts (the same in every
// thread).
template <class CountOf, class OnExpert>
__device__ __forceinline__ int scan_experts(int num_experts, int tile_m, ScanStorage& scan,
                                            CountOf count_of, OnExpert on_expert) {
  using Scan = cub::BlockScan<int, kThreads>;
  int rows_before = 0, tiles_before = 0;  // the same in every thread
  for (int g = 0; g < num_experts; g += kThreads) {
    const int e = g + static_cast<int>(threadIdx.x);
    const int c = e < num_experts ? count_of(e) : 0;
    const int tiles = c / tile_m + (c % tile_m != 0);
    int c_incl = 0, c_total = 0, t_excl = 0, t_total = 0;
    Scan(scan).InclusiveSum(c, c_incl, c_total);
    __syncthreads();
    Scan(scan).ExclusiveSum(tiles, t_excl, t_total);
    __syncthreads();
    if (e < num_experts) on_expert(e, c, rows_before + c_incl, tiles_before + t_excl);
    rows_before += c_total;
    tiles_before += t_total;
  }
  return tiles_before;
}

// The whole local plan of up to kOneBlockEntries entries (decode batches), by one
// block of kThreads threads: the per-warp counts of the first pass, summed per expert in shared
// memory, give the counts, row ends and tile bases, then the second pass the rows (the values of
// expert_tiles.cu's two-kernel plan). counts and dest_rank may be null. `on_expert(e, start, c)`
// runs once per expert, in the thread that wrote its row end, with its first row and its row
// count. `ready()` runs once the ids are loaded, before anything is written: where the launch
// behind this one may start.
template <class Ready, class OnExpert>
__device__ __forceinline__ void plan_one_block(
    const int64_t* __restrict__ ids, int64_t n, int num_experts, int tile_m, int64_t* counts,
    int32_t* __restrict__ offs, int32_t* __restrict__ tile_base, int64_t* dest_rank,
    int64_t* __restrict__ gemm_row, int64_t* __restrict__ counter,
    unsigned long long* __restrict__ error, Ready ready, OnExpert on_expert) {
  __shared__ int table[kWarps][kLocalExperts];
  __shared__ int start[kLocalExperts];  // the first row of each expert
  __shared__ int base[kLocalExperts];   // its first tile counter
  __shared__ ScanStorage scan;
  const int tid = static_cast<int>(threadIdx.x), warp = tid / 32, lane = tid % 32;
  // The batch split evenly over the warps, in whole steps of 32: the steps of one warp are a
  // chain, those of different warps run side by side.
  const int per_warp = static_cast<int>((n + kWarps - 1) / kWarps);
  const int seg_len = per_warp <= 32 ? 32 : (per_warp + 31) / 32 * 32;
  WarpEntries<kOneBlockWarpSteps> mine = load_warp_entries<kOneBlockWarpSteps>(
      ids, n, num_experts, int64_t{warp} * seg_len, seg_len, lane);
  ready();
  if (tid == 0) *error = 0;
  for (int e = tid; e < num_experts; e += kThreads)
#pragma unroll
    for (int w = 0; w < kWarps; ++w) table[w][e] = 0;
  __syncthreads();
  count_warp_entries(mine, lane, table[warp]);
  __syncthreads();
  const int tiles = scan_experts(
      num_experts, tile_m, scan,
      [&](int e) {
        int c = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) c += table[w][e];
        return c;
      },
      [&](int e, int c, int rows_end, int first_tile) {
        if (counts != nullptr) counts[e] = c;
        offs[e] = rows_end;
        tile_base[e] = first_tile;
        start[e] = rows_end - c;
        base[e] = first_tile;
        on_expert(e, start[e], c);
        // Each warp's first row of e: e's start, then the warps before it.
        int row = start[e];
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          const int cw = table[w][e];
          table[w][e] = row;
          row += cw;
        }
      });
  if (tid == 0) tile_base[num_experts] = tiles;
  __syncthreads();
  place_warp_entries(
      mine, n, num_experts, lane, table[warp],
      [&](int e, int row) { return base[e] + (row - start[e]) / tile_m; }, dest_rank, gemm_row,
      counter, error);
}

}  // namespace uniep::cuda::local_plan
