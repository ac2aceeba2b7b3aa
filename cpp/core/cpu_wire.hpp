// How a dispatched token row crosses the wire: raw in its storage type, or fp8 e4m3 with one
// fp32 scale per 1x128 block (the `dispatch=fp8` point of the tuning space).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cpu_exchange.hpp"
#include "core/numeric.hpp"
#include "uniep/tuning.hpp"

namespace uniep::cpu {

inline int64_t fp8_blocks(int64_t H) {
  return (H + numeric::kFp8BlockCols - 1) / numeric::kFp8BlockCols;
}

template <typename S>
int64_t wire_row_bytes(int64_t H, DispatchPrecision p) {
  if (p == DispatchPrecision::kFp8E4M3) return align8(H + fp8_blocks(H) * int64_t(sizeof(float)));
  return align8(H * int64_t(sizeof(S)));
}

template <typename S>
void encode_row(const S* row, int64_t H, DispatchPrecision p, uint8_t* out) {
  using St = numeric::Storage<S>;
  if (p != DispatchPrecision::kFp8E4M3) {
    std::memcpy(out, row, H * sizeof(S));
    return;
  }
  float* scales = reinterpret_cast<float*>(out + H);
  for (int64_t b = 0; b < fp8_blocks(H); ++b) {
    const int64_t c0 = b * numeric::kFp8BlockCols, c1 = std::min(H, c0 + numeric::kFp8BlockCols);
    float amax = 0.0f;
    for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(float(St::load(row[c]))));
    const numeric::Fp8BlockScale s = numeric::fp8_block_scale(amax);
    std::memcpy(&scales[b], &s.scale, sizeof s.scale);
    for (int64_t c = c0; c < c1; ++c)
      out[c] = numeric::float_to_e4m3(float(St::load(row[c])) * s.inv);
  }
}

// Each value of an fp8 record's row, `sink(column, value)`: the e4m3 value times its block
// scale, one fp32 product.
template <typename Sink>
void for_each_fp8_value(const uint8_t* in, int64_t H, Sink sink) {
  for (int64_t b = 0; b < fp8_blocks(H); ++b) {
    float scale;
    std::memcpy(&scale, in + H + b * sizeof(float), sizeof scale);
    const int64_t c0 = b * numeric::kFp8BlockCols, c1 = std::min(H, c0 + numeric::kFp8BlockCols);
    for (int64_t c = c0; c < c1; ++c) sink(c, numeric::e4m3_to_float(in[c]) * scale);
  }
}

// A record's row in the storage type (fp8 values rounded once to S).
template <typename S>
void decode_row(const uint8_t* in, int64_t H, DispatchPrecision p, S* row) {
  using St = numeric::Storage<S>;
  using Acc = typename St::Acc;
  if (p != DispatchPrecision::kFp8E4M3) {
    std::memcpy(row, in, H * sizeof(S));
    return;
  }
  for_each_fp8_value(in, H, [&](int64_t c, float v) { row[c] = St::store(Acc(v)); });
}

// An fp8 record's row as the fp8 experts read it: not rounded to the storage type.
template <typename Acc>
void decode_fp8_row(const uint8_t* in, int64_t H, Acc* row) {
  for_each_fp8_value(in, H, [&](int64_t c, float v) { row[c] = Acc(v); });
}

}  // namespace uniep::cpu
