// Scalar formats the CPU executor stores and sends, converted exactly as the GPU does it
// (round-to-nearest-even), so CPU and GPU paths can be compared bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace uniep::numeric {

struct Bf16 {
  uint16_t bits;
};

inline float bf16_to_float(Bf16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline Bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{0x7fc0};  // any NaN -> canonical quiet NaN
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

// fp8 e4m3 (OCP "fn" variant: no infinities, 0x7f/0xff NaN, max finite 448).
float e4m3_to_float(uint8_t v);
// Saturates to +-448; NaN maps to 0x7f.
uint8_t float_to_e4m3(float f);
constexpr float kE4m3Max = 448.0f;
constexpr int64_t kFp8BlockCols = 128;  // one scale per 1x128 block of a row

// A block's fp32 scale (amax / 448) and the reciprocal its values are multiplied by before the
// e4m3 rounding (one division each, as the GPU kernels do it); an all-zero block keeps scale 1
// so decoding never divides by zero.
struct Fp8BlockScale {
  float scale, inv;
};
inline Fp8BlockScale fp8_block_scale(float amax) {
  if (amax > 0.0f) return {amax / kE4m3Max, kE4m3Max / amax};
  return {1.0f, 1.0f};
}

// Storage traits: the accumulation type and the rounding on store for each storage type.
template <typename S>
struct Storage;
template <>
struct Storage<float> {
  using Acc = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
template <>
struct Storage<double> {
  using Acc = double;
  static double load(double v) { return v; }
  static double store(double v) { return v; }
};
template <>
struct Storage<Bf16> {
  using Acc = float;
  static float load(Bf16 v) { return bf16_to_float(v); }
  static Bf16 store(float v) { return float_to_bf16(v); }
};

}  // namespace uniep::numeric
