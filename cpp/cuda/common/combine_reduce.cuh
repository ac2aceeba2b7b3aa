// The last step of every combine (high-throughput and low-latency): the weighted sum over k of
// the rows that came back to the (token, k) slots. One definition, so the two combines give the
// same bits, and both the CPU executor's: fp32 accumulation in ascending k, each product and
// each sum rounded on its own (__fmul_rn/__fadd_rn, which nvcc never contracts into an FMA),
// one rounding to bf16 at the end. Slot-indexed, so the result never depends on which block
// carried a row or when it arrived.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/warp_copy.cuh"

namespace uniep::cuda {

// The combines' arithmetic, in one place so that every combine (high-throughput, low-latency,
// rank partials) rounds alike: acc[j] += w * y[j] over the 8 bf16 of one 16-byte vector, the
// product and the sum each rounded on its own.
__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[8], const int4& raw, float w) {
  const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, __bfloat162float(y[j])));
}

// The same over 8 fp32 values in two 16-byte vectors (combine=rank_partials' rows as the second
// product accumulated them).
__device__ __forceinline__ void accumulate_f32x8(float (&acc)[8], const int4& lo, const int4& hi,
                                                 float w) {
  const float* a = reinterpret_cast<const float*>(&lo);
  const float* b = reinterpret_cast<const float*>(&hi);
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, a[j]));
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[4 + j] = __fadd_rn(acc[4 + j], __fmul_rn(w, b[j]));
}

// acc rounded once to bf16, as one 16-byte vector.
__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
  int4 packed;
  __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16_rn(acc[j]);
  return packed;
}

// Rows that never left the rank (combine's self rows): entry (me, t, k) of the row index holds
// the expert output row that answers (t, k), tagged with the round; the reduction reads that
// row of y where the slot copy would have been the same bytes. Empty (index == nullptr) for the
// low-latency combine, whose rows all pass through the slots.
struct SelfRows {
  const uint64_t* index = nullptr;  // [tokens * top_k] of this rank: epoch << 32 | row
  uint32_t epoch = 0;
  const uint8_t* y = nullptr;  // [rows][hidden] bf16
};

// out[t] = sum_k topk_weights[t,k] * row_of(t, k, v)[v] over k in ascending order, for the
// rows row_of returns (nullptr: (t, k) adds nothing), in 16-byte vectors v: the loop of every
// reduce over k. hidden % 8 == 0, rows 16-byte aligned. Grid-stride: one thread per 8 columns of
// a token.
//
// The k rows are taken kLoadsInFlight at a time: their row indices and weights first, then their
// vectors, then the sums in ascending k. A loop that loaded, then added, one k at a time made
// 2K dependent trips to memory per thread, which at decode sizes (a few threads' worth of
// tokens) is the whole kernel; the order of the sums, hence the bits, is the same.
template <typename RowOf>
__device__ __forceinline__ void weighted_rows_sum_bf16(RowOf row_of, const float* topk_weights,
                                                       int64_t tokens, int64_t top_k,
                                                       int64_t hidden, uint8_t* out) {
  constexpr int kLoadsInFlight = 8;
  const int64_t K = top_k, row_bytes = hidden * 2, vecs = hidden / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < tokens * vecs;
       i += stride) {
    const int64_t t = i / vecs, v = i % vecs;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k0 = 0; k0 < K; k0 += kLoadsInFlight) {
      const uint8_t* rows[kLoadsInFlight];
      float w[kLoadsInFlight];
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j) {
        const bool in = k0 + j < K;
        rows[j] = in ? row_of(t, k0 + j, v) : nullptr;
        w[j] = in ? topk_weights[t * K + k0 + j] : 0.f;
      }
      int4 vals[kLoadsInFlight];
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j)
        if (rows[j] != nullptr)
          vals[j] = load_streaming(reinterpret_cast<const int4*>(rows[j]) + v);
#pragma unroll
      for (int j = 0; j < kLoadsInFlight; ++j)
        if (rows[j] != nullptr) accumulate_bf16x8(acc, vals[j], w[j]);
    }
    reinterpret_cast<int4*>(out + t * row_bytes)[v] = round_bf16x8(acc);
  }
}

// out[t] = sum_k topk_weights[t,k] * combine_(t,k) over k with topk_idx[t,k] >= 0, ascending.
//   combine       [tokens * top_k][hidden] bf16 slots, row (t * top_k + k) for (t, k)
//   topk_idx      [tokens, top_k] (only the sign is read); topk_weights [tokens, top_k] fp32
//   out           [tokens][hidden] bf16
//   self          where (t, k) is answered by one of our own rows, read it from y instead
// hidden % 8 == 0, rows 16-byte aligned. Grid-stride: one thread per 8 columns of a token.
__device__ __forceinline__ void combine_reduce_bf16(const uint8_t* combine, const int64_t* topk_idx,
                                                    const float* topk_weights, int64_t tokens,
                                                    int64_t top_k, int64_t hidden, uint8_t* out,
                                                    SelfRows self = {}) {
  const int64_t K = top_k, row_bytes = hidden * 2;
  auto row_of = [&](int64_t t, int64_t k, int64_t) -> const uint8_t* {
    if (topk_idx[t * K + k] < 0) return nullptr;
    if (self.index != nullptr) {
      const uint64_t entry = self.index[t * K + k];
      if (entry >> 32 == self.epoch) return self.y + static_cast<uint32_t>(entry) * row_bytes;
    }
    return combine + (t * K + k) * row_bytes;
  };
  weighted_rows_sum_bf16(row_of, topk_weights, tokens, top_k, hidden, out);
}

}  // namespace uniep::cuda
