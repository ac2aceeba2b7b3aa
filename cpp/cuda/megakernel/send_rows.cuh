// The device side of the MegaKernel's dispatch (include/uniep/cuda/send_rows.hpp): where this
// rank's (token, k) rows go (one block per global expert), and the warp that stores a token's
// row at each of its destinations and counts it on their tile gates. Device functions, so the
// persistent kernel can run them as its communication stage.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cstdint>

#include "cuda/megakernel/tile_gate.cuh"
#include "uniep/cuda/send_rows.hpp"

namespace uniep::cuda::megakernel {

__device__ __forceinline__ void send_error(unsigned long long* error, uint64_t code,
                                           int64_t entry) {
  atomicCAS(error, 0ull, static_cast<unsigned long long>(send_error_word(code, entry)));
}

// Block `g` (global expert g) of a plan. The block walks all of this rank's entries in
// (token, k) order, so the i-th entry routed to g gets the i-th row of (g, this rank) on g's
// rank: the order plan_sender_rows (cpp/core/experts.cpp) and the receiver's plan use.
constexpr int kPlanPerThread = 16;  // entries a lane holds per block scan (bits of a word)

template <int kThreads>
__device__ void plan_expert_rows(const SenderRowsPlanArgs& a, int64_t g) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } tmp;
  __shared__ int64_t first_row, first_tile, source_row, announced, order_base;
  const int64_t W = a.world_size, E = a.num_experts, El = E / W, me = a.rank;
  const int64_t dest = g / El, el = g % El, n = a.tokens * a.top_k;
  const int tid = static_cast<int>(threadIdx.x);

  // g's first row and first counter on its rank: the rows and tiles of the experts before it.
  int64_t rows_before = 0, tiles_before = 0;
  for (int64_t e = tid; e < el; e += kThreads) {
    int64_t rows = 0;
    for (int64_t s = 0; s < W; ++s) rows += a.counts[s * a.counts_ld + dest * El + e];
    rows_before += rows;
    tiles_before += (rows + a.tile_m - 1) / a.tile_m;
  }
  const int64_t rows_sum = Reduce(tmp.reduce).Sum(rows_before);
  __syncthreads();
  const int64_t tiles_sum = Reduce(tmp.reduce).Sum(tiles_before);
  // Where g's entries start in the send order: this rank's entries of the experts before g in
  // (index on its rank, rank) order.
  int64_t order_before = 0;
  if (a.send_order != nullptr) {
    for (int64_t h = tid; h < E; h += kThreads)
      if (h % El < el || (h % El == el && h / El < dest))
        order_before += a.counts[me * a.counts_ld + h];
  }
  __syncthreads();
  const int64_t order_sum = Reduce(tmp.reduce).Sum(order_before);
  if (tid == 0) {
    int64_t before_me = 0;
    for (int64_t s = 0; s < me; ++s) before_me += a.counts[s * a.counts_ld + g];
    first_row = rows_sum;
    first_tile = tiles_sum;
    order_base = order_sum;
    source_row = before_me;
    announced = a.counts[me * a.counts_ld + g];
  }
  __syncthreads();

  // A chunk of the walk is kThreads x kPlanPerThread entries and one block scan: warp w takes
  // entries [w x 32 x kPlanPerThread, (w + 1) x 32 x kPlanPerThread) of the chunk, lane l the
  // ones at l, l + 32, ... (coalesced loads, all in flight), and the warp orders its matches by
  // ballots. With one entry a thread and a scan each, a 32,768-entry rank took 32 scans and
  // 32 us on an H200 (Qwen3-like load), on the critical path of every MegaKernel call; with 16
  // consecutive entries a thread (uncoalesced loads) 24 us; this way 16 us.
  const int lane = tid % 32;
  const uint32_t below = (1u << lane) - 1u;  // the lanes before this one
  int64_t taken = 0;
  constexpr int64_t kChunk = int64_t{kThreads} * kPlanPerThread;
  for (int64_t base = 0; base < n; base += kChunk) {
    const int64_t first = base + int64_t{tid / 32} * 32 * kPlanPerThread + lane;
    uint32_t mine = 0;  // bit j: entry first + 32 j is routed to g
#pragma unroll
    for (int j = 0; j < kPlanPerThread; ++j) {
      const int64_t i = first + 32 * j;
      const int64_t id = i < n ? a.topk_idx[i] : -1;
      // Entries routed nowhere (or nowhere valid) are block 0's to mark.
      if (g == 0 && i < n && (id < 0 || id >= E)) {
        a.dest_rank[i] = a.gemm_row[i] = a.counter[i] = -1;
        if (id >= E || id < -1) send_error(a.error, kSendBadExpert, i);
      }
      if (id == g) mine |= 1u << j;
    }
    // The warps' matches in warp order: lane 0's exclusive sum is the warp's first match.
    int before = 0, total = 0;
    Scan(tmp.scan).ExclusiveSum(__popc(mine), before, total);
    int64_t next = taken + __shfl_sync(0xffffffffu, before, 0);
#pragma unroll
    for (int j = 0; j < kPlanPerThread; ++j) {
      const uint32_t hits = __ballot_sync(0xffffffffu, (mine >> j) & 1u);
      if ((mine >> j) & 1u) {
        const int64_t i = first + 32 * j, k = next + __popc(hits & below);
        if (k >= announced) {
          a.dest_rank[i] = a.gemm_row[i] = a.counter[i] = -1;
          send_error(a.error, kSendOverCount, i);
        } else {
          const int64_t in_expert = source_row + k;
          a.dest_rank[i] = dest;
          a.gemm_row[i] = first_row + in_expert;
          a.counter[i] = first_tile + in_expert / a.tile_m;
          // Counts that announce more than the routing holds leave holes and may run past the
          // end.
          if (a.send_order != nullptr && order_base + k < n) a.send_order[order_base + k] = i;
        }
      }
      next += __popc(hits);
    }
    taken += total;
    __syncthreads();  // the scan's storage is reused by the next chunk
  }
}

// One warp stores a row of row_bytes (a multiple of 16) at src to the destinations lanes
// 0..copies-1 hold in `dst` (null: none), every lane reading its 16-byte pieces once.
__device__ __forceinline__ void store_row_copies(const uint8_t* src, int64_t row_bytes,
                                                 uint8_t* dst, int copies, int lane) {
  const int64_t pieces = row_bytes / 16;
  const auto* from = reinterpret_cast<const int4*>(src);
  // Whole-warp trip counts: the shuffles need every lane.
  for (int64_t base = 0; base < pieces; base += 32) {
    const int64_t v = base + lane;
    const bool in_row = v < pieces;
    int4 piece = make_int4(0, 0, 0, 0);
    if (in_row) piece = __ldg(from + v);
    for (int k = 0; k < copies; ++k) {
      auto* to = reinterpret_cast<int4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(dst), k));
      if (in_row && to != nullptr) to[v] = piece;
    }
  }
}

// One warp stores token t's row at its GEMM rows on this GPU (store_token_rows_async): lanes
// k < top_k hold the rows of entries (t, k); unused entries and rows past the capacity store
// nothing (the plan that made the rows records its failures in its own word).
__device__ __forceinline__ void store_token_row(const StoreRowsArgs& a, int64_t t, int lane) {
  uint8_t* dst = nullptr;
  if (lane < a.top_k) {
    const int64_t row = a.gemm_row[t * a.top_k + lane];
    if (row >= 0 && row < a.rows_capacity) dst = static_cast<uint8_t*>(a.rows) + row * a.row_stride;
  }
  store_row_copies(static_cast<const uint8_t*>(a.x) + t * a.x_stride, a.row_bytes, dst,
                   static_cast<int>(a.top_k), lane);
}

// One warp sends token t: lanes k < top_k hold the destinations of entries (t, k), every lane
// reads its 16-byte pieces of the row once and stores each at every destination.
__device__ __forceinline__ void send_token_row(const SendRowsArgs& a, const RowPeers& p,
                                               int64_t t, int lane) {
  uint8_t* dst = nullptr;
  uint32_t* counter = nullptr;
  if (lane < a.top_k) {
    const int64_t i = t * a.top_k + lane, d = a.dest_rank[i];
    if (d >= 0) {
      const int64_t row = a.gemm_row[i], c = a.counter[i];
      const uint64_t code =
          send_entry_check(d, row, c, p.num_peers, p.rows_capacity, p.num_counters);
      if (code != 0) {
        send_error(a.error, code, i);
      } else {
        dst = p.rows[d] + row * p.row_stride;
        counter = p.counters[d] + c;
      }
    }
  }
  store_row_copies(static_cast<const uint8_t*>(a.x) + t * a.x_stride, a.row_bytes, dst,
                   static_cast<int>(a.top_k), lane);
  // Every lane's stores are ordered before the counters at system scope (a peer GPU's GEMM
  // acquires them), and the warp's barrier orders them before each lane's release.
  __threadfence_system();
  __syncwarp();
  if (counter != nullptr) gate_signal(counter, 1u);
}

}  // namespace uniep::cuda::megakernel
