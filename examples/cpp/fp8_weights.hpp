// The decode example's fp8 experts: bf16 weights quantized on the host into MoeLayer's fp8
// format (MoeLayerConfig::fp8_experts): e4m3 (OCP "fn"), one fp32 scale per 128 x 128 block,
// stored K-major. The same rounding as the CPU executor's fp8 experts (amax / 448 a block, the
// values times 448 / amax rounded to nearest even and saturated at 448), so the GPU layer and the
// CPU executor multiply the same values. A server would load such weights from its checkpoint
// (or make them with uniep.gemm.quantize_expert_weights) instead.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "example_support.hpp"

namespace decode {

// e4m3 "fn": 4 exponent bits (bias 7), 3 mantissa bits, no infinities, largest finite 448.
inline uint8_t to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fmin(std::fabs(f), 448.0f);
  int e = 0;
  std::frexp(a, &e);                                // a = m 2^e, m in [0.5, 1)
  const int exp = std::max(e - 1, -6);              // subnormals share 2^-6's step
  const float step = std::ldexp(1.0f, exp - 3);     // 3 mantissa bits
  const float r = std::nearbyint(a / step) * step;  // to nearest, ties to even
  if (r == 0.0f) return sign;
  std::frexp(r, &e);
  if (e - 1 < -6) return sign | static_cast<uint8_t>(r / std::ldexp(1.0f, -9));  // subnormal
  const int mant = static_cast<int>(r / std::ldexp(1.0f, e - 4)) - 8;
  return sign | static_cast<uint8_t>(((e - 1 + 7) << 3) | mant);
}

// w [E][K][N] bf16 -> q [E][N][K] e4m3 and scales [E][K / 128][N / 128].
inline void quantize_fp8(const std::vector<uint16_t>& w, int64_t experts, int64_t K, int64_t N,
                         std::vector<uint8_t>* q, std::vector<float>* scales) {
  constexpr int64_t B = 128;
  q->assign(experts * N * K, 0);
  scales->assign(experts * (K / B) * (N / B), 1.0f);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t kb = 0; kb < K / B; ++kb)
      for (int64_t nb = 0; nb < N / B; ++nb) {
        float amax = 0.0f;
        for (int64_t k = kb * B; k < (kb + 1) * B; ++k)
          for (int64_t n = nb * B; n < (nb + 1) * B; ++n)
            amax = std::fmax(amax, std::fabs(example::from_bf16(w[(e * K + k) * N + n])));
        const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        const float inv = amax > 0.0f ? 448.0f / amax : 1.0f;
        (*scales)[(e * (K / B) + kb) * (N / B) + nb] = scale;
        for (int64_t k = kb * B; k < (kb + 1) * B; ++k)
          for (int64_t n = nb * B; n < (nb + 1) * B; ++n)
            (*q)[(e * N + n) * K + k] = to_e4m3(example::from_bf16(w[(e * K + k) * N + n]) * inv);
      }
}

// q1 [E][2 ffn][K] and s1 [E][K / 128][2 ffn / 128] (quantize_fp8 of w1) packed for the first
// GEMM's SwiGLU epilogue (MoeLayerConfig::fp8_w1_packed): packed row c + 64 g + 128 j is row
// g ffn + 64 j + c, and each 64-row group keeps its 128 x 128 block's scale.
inline void pack_gate_up_fp8(const std::vector<uint8_t>& q1, const std::vector<float>& s1,
                             int64_t experts, int64_t K, int64_t ffn, std::vector<uint8_t>* q,
                             std::vector<float>* s) {
  constexpr int64_t B = 128, H = 64;
  q->assign(q1.size(), 0);
  s->assign(experts * (K / B) * (2 * ffn / H), 0.0f);
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t j = 0; j < ffn / H; ++j)
      for (int64_t g = 0; g < 2; ++g) {
        const int64_t from = g * ffn + H * j, to = 2 * H * j + H * g;
        for (int64_t c = 0; c < H; ++c)
          for (int64_t k = 0; k < K; ++k)
            (*q)[(e * 2 * ffn + to + c) * K + k] = q1[(e * 2 * ffn + from + c) * K + k];
        for (int64_t kb = 0; kb < K / B; ++kb)
          (*s)[(e * (K / B) + kb) * (2 * ffn / H) + 2 * j + g] =
              s1[(e * (K / B) + kb) * (2 * ffn / B) + from / B];
      }
}

}  // namespace decode
