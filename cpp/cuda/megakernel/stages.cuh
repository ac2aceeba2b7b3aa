// The stages of the fused MoE kernel around its GEMMs (include/uniep/cuda/fused_moe.hpp): the
// send of the rows by the communication CTAs before they compute (into the GEMM rows of the
// rows' ranks), and the reduce of the rank's tokens by every CTA's consumer warps after its tiles
// (reading each expert output on the rank that computed it).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/combine_reduce.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/megakernel/send_rows.cuh"
#include "cuda/megakernel/tile_gate.cuh"
#include "uniep/cuda/fused_moe.hpp"

namespace uniep::cuda::megakernel {

// 16-byte pieces a lane keeps in flight: one SM moves a row store only as fast as its loads
// return, so the send needs many outstanding loads per warp.
constexpr int kSendUnroll = 16;
// The same for the batched row copies of fewer senders than SMs, whose share of the send is
// bound by the bytes each SM keeps in flight (32 x 512 bytes a warp).
constexpr int kBatchUnroll = 32;
// Rows a warp stores between releases (<= 32: one lane signals each).
constexpr int kSendBatch = 16;
// Expert rows of a token the reduce loads before it adds them.
constexpr int kReduceChunk = 4;
// The fused reduce cuts tokens into column pieces up to this many tokens (fused_reduce_tokens).
constexpr int64_t kSplitReduceTokens = 512;

// Where entry i of the plan (token i / top_k's expert i % top_k) goes: to(row, counter, rank)
// with its GEMM row, its tile counter and, with peers, its expert's rank (0 without). Not called
// where the entry is routed nowhere (row -1), nor where the plan points outside the buffers
// (recorded in the error word: kSendRowOutOfRange). Args is FusedMoeArgs or FusedBackwardArgs.
template <class Args, class To>
__device__ __forceinline__ void with_entry_dest(const Args& a, int64_t i, bool peers, To&& to) {
  const int64_t r = a.gemm_row[i], c = a.counter[i];
  const int64_t d = peers ? a.dest_rank[i] : 0;
  if (r >= 0) {
    if (r >= a.capacity || c < 0 || c >= a.num_counters || d < 0 || d >= a.peers.world_size)
      send_error(a.error, kSendRowOutOfRange, i);
    else
      to(r, c, d);
  }
}

// The batch's rows packed into lanes 0 .. popc(valid) - 1 for warp_copy_rows: lane j <
// kSendBatch holds its row's source and destination (null where the row is not sent).
__device__ __forceinline__ int pack_batch_rows(const int4*& src, int4*& dst, int lane) {
  const unsigned valid = __ballot_sync(0xffffffffu, src != nullptr);
  const int4* s = nullptr;
  int4* d = nullptr;
#pragma unroll
  for (int b = 0; b < kSendBatch; ++b) {
    const auto* sb = reinterpret_cast<const int4*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(src), b));
    auto* db = reinterpret_cast<int4*>(
        __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(dst), b));
    if ((valid >> b & 1u) && lane == __popc(valid & ((1u << b) - 1u))) {
      s = sb;
      d = db;
    }
  }
  src = s;
  dst = d;
  return __popc(valid);
}

// Warp `warp` of `warps` stores GEMM rows warp, warp + warps, ... : row r gets x[token of
// row_entry[r]] and its tile counter 1. Rows go in increasing order, so the first experts'
// first tiles are complete first, which is the order the GEMM takes them in. A warp stores
// kSendBatch rows before their signals (each release waits for the warp's stores to land: once
// per row it would keep the warp idle for a round trip per row), with the batch's indices
// loaded by its lanes at once and its rows copied as one run (warp_copy_rows): row by row, a
// sending SM had moved ~8-12 GB/s on an H200 (2026-11-28, commit 089ae1c), the round trips of
// each row's index loads and copy in a chain.
__device__ __forceinline__ void fused_send_rows(const FusedMoeArgs& a, int64_t warp, int64_t warps,
                                                int lane) {
  const int pieces = static_cast<int>(a.hidden * 2 / 16);
  const int64_t n = a.tokens * a.top_k, stride = warps * kSendBatch;
  const auto* x = static_cast<const int4*>(a.x);
  auto* rows = static_cast<int4*>(a.rows);
  // Lane j < kSendBatch: the entry of the batch's j-th row and its counter, fetched a batch
  // ahead (the next batch's entries during this batch's copy, their counters during its
  // release) so that the index loads' round trips do not stall the copy.
  auto entry_of = [&](int64_t r0) {
    const int64_t r = r0 + lane * warps;
    return lane < kSendBatch && r < a.capacity ? a.row_entry[r] : int64_t{-1};
  };
  auto counter_of = [&](int64_t entry) {
    return entry >= 0 ? (entry < n ? a.counter[entry] : int64_t{-1}) : int64_t{0};
  };
  int64_t entry = entry_of(warp);
  int64_t c = counter_of(entry);
  for (int64_t r0 = warp; r0 < a.capacity; r0 += stride) {
    const int4* src = nullptr;
    int4* dst = nullptr;
    int64_t signal = -1;  // lane j < kSendBatch: the counter of the batch's j-th row
    if (entry >= 0) {
      if (c < 0 || c >= a.num_counters) {
        send_error(a.error, kSendRowOutOfRange, entry);
      } else {
        src = x + (entry / a.top_k) * pieces;
        dst = rows + (r0 + lane * warps) * pieces;
        signal = c;
      }
    }
    const int64_t next = entry_of(r0 + stride);
    const int count = pack_batch_rows(src, dst, lane);
    if (count > 0) warp_copy_rows<kBatchUnroll>(src, dst, count, pieces, lane);
    entry = next;
    c = counter_of(next);
    __syncwarp();
    if (signal >= 0) gate_signal_gpu(a.counters + signal, 1u);
  }
}

// The whole warp stores one token's row (`pieces` 16-byte pieces at src, read once) at the
// destinations lanes 0 .. K - 1 hold in `dst` (null: none).
__device__ __forceinline__ void store_token_row(const int4* src, int4* dst, int64_t pieces, int K,
                                                int lane) {
  // Whole-warp trip counts: the shuffles need every lane.
  for (int64_t base = 0; base < pieces; base += 32 * kSendUnroll) {
    int4 v[kSendUnroll];
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u)
      if (base + 32 * u + lane < pieces) v[u] = __ldg(src + base + 32 * u + lane);
    for (int k = 0; k < K; ++k) {
      auto* to = reinterpret_cast<int4*>(
          __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(dst), k));
      if (to == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kSendUnroll; ++u)
        if (base + 32 * u + lane < pieces) to[base + 32 * u + lane] = v[u];
    }
  }
}

// After a warp stored a token's rows: each lane's counter (null: none) counts its row once every
// lane's stores are visible to whoever acquires it. With peers a peer GPU acquires it: a system
// fence per lane (once per token and lane, which a send can afford; a GEMM epilogue cannot), then
// a release at system scope; on one GPU the warp barrier and a release at GPU scope.
__device__ __forceinline__ void publish_token_rows(uint32_t* signal, bool peers) {
  if (peers) {
    __threadfence_system();
    __syncwarp();
    if (signal != nullptr) gate_signal(signal, 1u);
  } else {
    __syncwarp();
    if (signal != nullptr) gate_signal_gpu(signal, 1u);
  }
}

// Warp `warp` of `warps` takes tokens warp, warp + warps, ... and stores each token's row at all
// of its GEMM rows, reading it once (the row order above reads it once per k): every CTA's order
// when every CTA sends (no overlap to feed), and the order with several ranks, whose rows go to
// the GEMM rows of their experts' ranks. Lane k < top_k holds entry (t, k)'s destination.
__device__ __forceinline__ void fused_send_tokens(const FusedMoeArgs& a, int64_t warp,
                                                  int64_t warps, int lane) {
  const int64_t pieces = a.hidden * 2 / 16, K = a.top_k;
  const bool peers = a.peers.world_size > 1;
  const auto* x = static_cast<const int4*>(a.x);
  for (int64_t t = warp; t < a.tokens; t += warps) {
    int4* dst = nullptr;
    uint32_t* signal = nullptr;
    if (lane < K) {
      const int64_t i = t * K + lane;
      with_entry_dest(a, i, peers, [&](int64_t r, int64_t c, int64_t d) {
        dst = static_cast<int4*>(peers ? a.peers.rows[d] : a.rows) + r * pieces;
        signal = (peers ? a.peers.counters[d] : a.counters) + c;
        // Where GEMM 2's epilogue on d sends the row's output: this rank's slot (t, k).
        if (peers) a.peers.row_src[d][r] = a.peers.rank * a.peers.slots_per_rank + i;
      });
    }
    store_token_row(x + t * pieces, dst, pieces, static_cast<int>(K), lane);
    publish_token_rows(signal, peers);
  }
}

// With peers and fewer senders than CTAs: warp `warp` of `warps` stores entries
// send_order[warp], send_order[warp + warps], ...: every rank's first experts first, the order
// in which each rank's GEMMs take their tiles, so the other CTAs' tiles start while the send
// goes on. As in fused_send_rows, a warp's lanes load the batch's indices at once and its rows
// go as one run (reading each token's row once per entry); then one system fence per lane
// covers them all before their signals.
__device__ __forceinline__ void fused_send_order(const FusedMoeArgs& a, int64_t warp, int64_t warps,
                                                 int lane) {
  const int pieces = static_cast<int>(a.hidden * 2 / 16);
  const int64_t n = a.tokens * a.top_k, stride = warps * kSendBatch;
  const auto* x = static_cast<const int4*>(a.x);
  // Lane b < kSendBatch: the batch's b-th entry (-1: none; past this rank's routed entries)
  // and its row, counter and rank, fetched a batch ahead as in fused_send_rows.
  auto entry_of = [&](int64_t j0) {
    const int64_t j = j0 + lane * warps;
    const int64_t i = lane < kSendBatch && j < n ? a.send_order[j] : int64_t{-1};
    return i >= 0 && i < n ? i : int64_t{-1};
  };
  struct Dest {
    int64_t r = -1, c = -1, d = -1;
  };
  auto dest_of = [&](int64_t i) {
    Dest t;
    if (i >= 0) {
      t.r = a.gemm_row[i];
      t.c = a.counter[i];
      t.d = a.dest_rank[i];
    }
    return t;
  };
  int64_t i = entry_of(warp);
  Dest t = dest_of(i);
  for (int64_t j0 = warp; j0 < n; j0 += stride) {
    const int4* src = nullptr;
    int4* dst = nullptr;
    uint32_t* signal = nullptr;  // lane b < kSendBatch: the counter of the batch's b-th row
    if (i >= 0) {
      if (t.r < 0 || t.r >= a.capacity || t.c < 0 || t.c >= a.num_counters || t.d < 0 ||
          t.d >= a.peers.world_size) {
        send_error(a.error, kSendRowOutOfRange, i);
      } else {
        src = x + (i / a.top_k) * pieces;
        dst = static_cast<int4*>(a.peers.rows[t.d]) + t.r * pieces;
        a.peers.row_src[t.d][t.r] = a.peers.rank * a.peers.slots_per_rank + i;
        signal = a.peers.counters[t.d] + t.c;
      }
    }
    const int64_t next = entry_of(j0 + stride);
    const int count = pack_batch_rows(src, dst, lane);
    if (count > 0) warp_copy_rows<kBatchUnroll>(src, dst, count, pieces, lane);
    i = next;
    t = dest_of(next);
    __threadfence_system();
    __syncwarp();
    if (signal != nullptr) gate_signal(signal, 1u);
  }
}

// The calling lane waits until `counter` (a done2 tile counter, maybe a peer's) reaches `need`.
// False if it timed out (recorded with flag 3, naming the token and k).
__device__ __forceinline__ bool fused_wait_row(const FusedMoeArgs& a, const uint32_t* counter,
                                               uint32_t need, int64_t token, int k) {
  uint32_t have = load_acquire_u32(counter);
  if (have >= need) return true;
  const uint64_t deadline = a.timeout_ns ? global_timer_ns() + a.timeout_ns : ~0ull;
  while (have < need) {
    __nanosleep(128);
    if (global_timer_ns() > deadline) {
      gate_report(a.timeout, 3u, static_cast<int>(token), k, have, need);
      return false;
    }
    if (gate_failed(a.timeout)) return false;
    have = load_acquire_u32(counter);
  }
  return true;
}

// Each warp takes tokens by ticket (`ticket` counts the tokens handed out, zeroed before the
// launch) and reduces each: out[t] = sum over k ascending of w[t, k] * y[gemm_row[t, k]], with
// the combines' arithmetic (combine_reduce.cuh), each row read once GEMM 2 has signalled its
// tile complete (`need` warps; with peers the tile is on the entry's rank, whose epilogue stored
// the row in this rank's combine slot t x top_k + k). Tickets and not a fixed share per warp:
// the CTAs leave the GEMM body 50-200 us apart (the static round-robin gives some a tile more),
// and with fixed shares the last to leave still had its whole share to do (one H200: the CTAs'
// reduces ended 775-809 us into the Qwen3-like call, 795-805 with tickets). Which warp reduces
// a token never changes its bits. Up to kSplitReduceTokens tokens (decode), a ticket is one
// 512-column piece of a token rather than the whole row, so the pieces run side by side: one
// warp walking a 7168-wide row's 14 pieces in turn left 35 us between the last GEMM tile and
// the end of a 1-token call, the pieces on their own warps 12 us (one H200, 2026-12-02).
__device__ __forceinline__ void fused_reduce_tokens(const FusedMoeArgs& a, uint32_t* ticket,
                                                    int lane, uint32_t need) {
  const int64_t K = a.top_k, vecs = a.hidden / 8, row_bytes = a.hidden * 2;
  const bool peers = a.peers.world_size > 1;
  auto* out = static_cast<uint8_t*>(a.out);
  // Tickets a token is cut into: pieces of 64 vectors (one pass of the loop below), or one.
  const int64_t pieces = a.tokens <= kSplitReduceTokens ? (vecs + 63) / 64 : 1;
  for (;;) {
    uint32_t taken = 0;
    if (lane == 0) taken = atomicAdd(ticket, 1u);
    const int64_t u = __shfl_sync(0xffffffffu, taken, 0);
    const int64_t t = u / pieces;
    if (t >= a.tokens) break;
    const int64_t begin = pieces == 1 ? 0 : (u % pieces) * 64;
    const int64_t end = pieces == 1 ? vecs : begin + 64;
    const uint8_t* row = nullptr;    // lane k: entry (t, k)'s expert output
    const uint32_t* done = nullptr;  // and its tile's done2 counter
    float w = 0.f;
    if (lane < K) {
      const int64_t i = t * K + lane;
      w = a.topk_weights[i];
      with_entry_dest(a, i, peers, [&](int64_t r, int64_t index, int64_t d) {
        row = peers ? static_cast<const uint8_t*>(a.peers.combine[a.peers.rank]) + i * row_bytes
                    : static_cast<const uint8_t*>(a.y) + r * row_bytes;
        // The call's set of done counters (read here, not held across the loop: registers).
        const int64_t set = a.parity_epoch != nullptr
                                ? static_cast<int64_t>(*a.parity_epoch & 1) * a.done2_parity_stride
                                : 0;
        done = (peers ? a.peers.done2[d] : a.done2) + set + index;
      });
    }
    // Lane k waits for entry (t, k)'s tile, the top_k lanes side by side. Every lane acquiring
    // every counter in turn cost a round trip per k after the token's last tile (acquires do not
    // overlap): side by side, a one-token call replayed 1-4% faster on bench_decode's two loads
    // (one H200, 2026-12-02). The warp barrier below orders the other lanes' row loads after
    // lane k's acquire.
    if (done != nullptr && !fused_wait_row(a, done, need, t, lane))
      row = nullptr;  // its output is garbage; leave it out
    __syncwarp();
    // Each lane keeps 2 vectors x kReduceChunk rows in flight: the loads of a chunk are issued
    // before any of them is added, and the sums still run in ascending k. Whole-warp trip counts:
    // the shuffles need every lane.
    for (int64_t base = begin; base < end; base += 64) {
      const int64_t v0 = base + lane, v1 = base + 32 + lane;
      float acc0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float acc1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < K; k0 += kReduceChunk) {
        const int4* src[kReduceChunk];
        float wk[kReduceChunk];
        int4 raw0[kReduceChunk], raw1[kReduceChunk];
#pragma unroll
        for (int j = 0; j < kReduceChunk; ++j) {
          const int k = k0 + j < K ? k0 + j : 0;
          src[j] = reinterpret_cast<const int4*>(
              __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), k));
          wk[j] = __shfl_sync(0xffffffffu, w, k);
          if (k0 + j >= K) src[j] = nullptr;
          // Written during this kernel (y here, or a combine slot by a peer GPU's epilogue):
          // loads after the acquire above, of lines this SM has not read before.
          if (src[j] != nullptr && v0 < vecs) raw0[j] = src[j][v0];
          if (src[j] != nullptr && v1 < vecs) raw1[j] = src[j][v1];
        }
#pragma unroll
        for (int j = 0; j < kReduceChunk; ++j) {
          if (src[j] == nullptr) continue;
          if (v0 < vecs) accumulate_bf16x8(acc0, raw0[j], wk[j]);
          if (v1 < vecs) accumulate_bf16x8(acc1, raw1[j], wk[j]);
        }
      }
      auto* dst = reinterpret_cast<int4*>(out + t * row_bytes);
      if (v0 < vecs) dst[v0] = round_bf16x8(acc0);
      if (v1 < vecs) dst[v1] = round_bf16x8(acc1);
    }
  }
}

}  // namespace uniep::cuda::megakernel
