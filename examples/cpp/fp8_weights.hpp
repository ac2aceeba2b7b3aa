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

}  // namespace decode
