#include "core/numeric.hpp"

#include <array>
#include <cmath>

namespace uniep::numeric {

namespace {

float e4m3_magnitude(uint8_t bits) {
  const int exp = (bits >> 3) & 0xf, man = bits & 7;
  if (exp == 0) return std::ldexp(static_cast<float>(man) / 8.0f, -6);
  return std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
}

// Magnitudes of codes 0..126 (127 is NaN), increasing with the code.
const std::array<float, 127>& e4m3_table() {
  static const std::array<float, 127> table = [] {
    std::array<float, 127> t{};
    for (int i = 0; i < 127; ++i) t[i] = e4m3_magnitude(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

}  // namespace

float e4m3_to_float(uint8_t v) {
  if ((v & 0x7f) == 0x7f) return std::nanf("");
  const float m = e4m3_magnitude(v & 0x7f);
  return (v & 0x80) ? -m : m;
}

uint8_t float_to_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  const auto& t = e4m3_table();
  if (a >= t[126]) return sign | 126;
  // First code with magnitude >= a, then pick the nearer neighbour, ties to the even code.
  int lo = 0, hi = 126;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (t[mid] < a)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0 || t[lo] == a) return sign | static_cast<uint8_t>(lo);
  const float up = t[lo] - a, down = a - t[lo - 1];
  int code = lo;
  if (down < up || (down == up && ((lo - 1) & 1) == 0)) code = lo - 1;
  return sign | static_cast<uint8_t>(code);
}

}  // namespace uniep::numeric
