// The stages of the fused MoE kernel around its GEMMs (include/uniep/cuda/fused_moe.hpp): the
// send of the rows by the communication CTAs before they compute, and the reduce of the tokens
// by every CTA's consumer warps after its tiles.
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
// Rows a warp stores between releases (<= 32: one lane signals each).
constexpr int kSendBatch = 4;
// Expert rows of a token the reduce loads before it adds them.
constexpr int kReduceChunk = 4;

// Warp `warp` of `warps` stores GEMM rows warp, warp + warps, ... : row r gets x[token of
// row_entry[r]] and its tile counter 1. Rows go in increasing order, so the first experts'
// first tiles are complete first, which is the order the GEMM takes them in. A warp stores
// kSendBatch rows before their signals: each release waits for the warp's stores to land, and
// once per row it would keep the warp idle for a round trip per row.
__device__ __forceinline__ void fused_send_rows(const FusedMoeArgs& a, int64_t warp, int64_t warps,
                                                int lane) {
  const int64_t pieces = a.hidden * 2 / 16;
  const auto* x = static_cast<const int4*>(a.x);
  auto* rows = static_cast<int4*>(a.rows);
  for (int64_t r0 = warp; r0 < a.capacity; r0 += warps * kSendBatch) {
    int64_t signal = -1;  // lane j < kSendBatch: the counter of the batch's j-th row
    for (int j = 0; j < kSendBatch; ++j) {
      const int64_t r = r0 + j * warps;
      if (r >= a.capacity) break;
      const int64_t entry = a.row_entry[r];
      if (entry < 0) continue;
      const int64_t c = entry < a.tokens * a.top_k ? a.counter[entry] : -1;
      if (c < 0 || c >= a.num_counters) {
        if (lane == 0) send_error(a.error, kSendRowOutOfRange, entry);
        continue;
      }
      const int64_t t = entry / a.top_k;
      warp_copy<kSendUnroll>(rows + r * pieces, x + t * pieces, pieces * 16, lane);
      if (lane == j) signal = c;
    }
    __syncwarp();
    if (signal >= 0) gate_signal_gpu(a.counters + signal, 1u);
  }
}

// Every CTA sends before it computes (no overlap to feed): warp `warp` of `warps` takes tokens
// warp, warp + warps, ... and stores each token's row at all of its GEMM rows, reading it once
// (the row order above reads it once per k). Lane k < top_k holds entry (t, k)'s destination.
__device__ __forceinline__ void fused_send_tokens(const FusedMoeArgs& a, int64_t warp,
                                                  int64_t warps, int lane) {
  const int64_t pieces = a.hidden * 2 / 16, K = a.top_k;
  const auto* x = static_cast<const int4*>(a.x);
  auto* rows = static_cast<int4*>(a.rows);
  for (int64_t t = warp; t < a.tokens; t += warps) {
    int4* dst = nullptr;
    int64_t signal = -1;
    if (lane < K) {
      const int64_t i = t * K + lane, r = a.gemm_row[i], c = a.counter[i];
      if (r >= 0) {
        if (r >= a.capacity || c < 0 || c >= a.num_counters) {
          send_error(a.error, kSendRowOutOfRange, i);
        } else {
          dst = rows + r * pieces;
          signal = c;
        }
      }
    }
    const int4* src = x + t * pieces;
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
    __syncwarp();
    if (signal >= 0) gate_signal_gpu(a.counters + signal, 1u);
  }
}

// Waits (one lane's loads suffice for the warp after __syncwarp, but every lane acquires so each
// one's later loads are ordered after it) until tile counter `index` of done2 reaches `need`.
// False if it timed out (recorded with flag 3).
__device__ __forceinline__ bool fused_wait_row(const FusedMoeArgs& a, int64_t index,
                                               uint32_t need, int64_t token, int k, int lane) {
  const uint32_t* counter = a.done2 + index;
  uint32_t have = load_acquire_u32(counter);
  if (have >= need) return true;
  const uint64_t deadline = a.timeout_ns ? gate_clock_ns() + a.timeout_ns : ~0ull;
  while (have < need) {
    __nanosleep(128);
    if (gate_clock_ns() > deadline) {
      if (lane == 0)
        gate_report(a.timeout, 3u, static_cast<int>(token), k, have, need);
      return false;
    }
    have = load_acquire_u32(counter);
  }
  return true;
}

// Warp `warp` of `warps` reduces tokens warp, warp + warps, ...: out[t] = sum over k ascending of
// w[t, k] * y[gemm_row[t, k]], with the combines' arithmetic (combine_reduce.cuh), each row read
// once GEMM 2 has signalled its tile complete (`need` warps).
__device__ __forceinline__ void fused_reduce_tokens(const FusedMoeArgs& a, int64_t warp,
                                                    int64_t warps, int lane, uint32_t need) {
  const int64_t K = a.top_k, vecs = a.hidden / 8, row_bytes = a.hidden * 2;
  const auto* y = static_cast<const uint8_t*>(a.y);
  auto* out = static_cast<uint8_t*>(a.out);
  for (int64_t t = warp; t < a.tokens; t += warps) {
    int64_t row = -1, index = -1;
    float w = 0.f;
    if (lane < K) {
      row = a.gemm_row[t * K + lane];
      index = a.counter[t * K + lane];
      w = a.topk_weights[t * K + lane];
      if (row >= a.capacity || (row >= 0 && (index < 0 || index >= a.num_counters))) {
        send_error(a.error, kSendRowOutOfRange, t * K + lane);
        row = -1;
      }
    }
    for (int k = 0; k < K; ++k) {
      const int64_t rk = __shfl_sync(0xffffffffu, row, k);
      const int64_t ik = __shfl_sync(0xffffffffu, index, k);
      if (rk >= 0 && !fused_wait_row(a, ik, need, t, k, lane))
        if (lane == k) row = -1;  // its output is garbage; leave it out
    }
    __syncwarp();
    // Each lane keeps 2 vectors x kReduceChunk rows in flight: the loads of a chunk are issued
    // before any of them is added, and the sums still run in ascending k. Whole-warp trip counts:
    // the shuffles need every lane.
    for (int64_t base = 0; base < vecs; base += 64) {
      const int64_t v0 = base + lane, v1 = base + 32 + lane;
      float acc0[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      float acc1[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k0 = 0; k0 < K; k0 += kReduceChunk) {
        int64_t rk[kReduceChunk];
        float wk[kReduceChunk];
        int4 raw0[kReduceChunk], raw1[kReduceChunk];
#pragma unroll
        for (int j = 0; j < kReduceChunk; ++j) {
          const int k = k0 + j < K ? k0 + j : 0;
          rk[j] = __shfl_sync(0xffffffffu, row, k);
          wk[j] = __shfl_sync(0xffffffffu, w, k);
          if (k0 + j >= K) rk[j] = -1;
          // y is written by this kernel: coherent loads, after the acquire above.
          const int4* src = reinterpret_cast<const int4*>(y + (rk[j] < 0 ? 0 : rk[j]) * row_bytes);
          if (rk[j] >= 0 && v0 < vecs) raw0[j] = src[v0];
          if (rk[j] >= 0 && v1 < vecs) raw1[j] = src[v1];
        }
#pragma unroll
        for (int j = 0; j < kReduceChunk; ++j) {
          if (rk[j] < 0) continue;
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
