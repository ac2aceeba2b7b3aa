#include "uniep/fp8_weights.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/numeric.hpp"
#include "uniep/status.hpp"

namespace uniep {

namespace {

constexpr int64_t kBlock = kFp8WeightBlock;
constexpr int64_t kHalf = kGateUpPackRows;
// Far past any expert weight, yet E x N x K stays inside int64 (2**60).
constexpr int64_t kMaxSide = int64_t{1} << 20;

void check_sizes(int64_t experts, int64_t k, int64_t n, const char* k_name, const char* n_name) {
  UNIEP_CHECK(experts >= 0 && experts <= kMaxSide, "experts must be in [0, ", kMaxSide, "], got ",
              experts);
  UNIEP_CHECK(k > 0 && k <= kMaxSide && k % kBlock == 0, k_name,
              " must be a positive multiple of 128 (one scale per 128 x 128 block) up to ",
              kMaxSide, ", got ", k);
  UNIEP_CHECK(n > 0 && n <= kMaxSide && n % kBlock == 0, n_name,
              " must be a positive multiple of 128 (one scale per 128 x 128 block) up to ",
              kMaxSide, ", got ", n);
}

void check_ffn(int64_t ffn) {
  UNIEP_CHECK(ffn > 0 && ffn <= kMaxSide && ffn % kHalf == 0,
              "ffn must be a positive multiple of 64 (w1 packed in blocks of 64 gate and 64 up "
              "rows) up to ",
              kMaxSide, ", got ", ffn);
}

}  // namespace

void quantize_expert_weights_fp8(const uint16_t* w, int64_t experts, int64_t k, int64_t n,
                                 uint8_t* q, float* scales) {
  check_sizes(experts, k, n, "k", "n");
  if (experts == 0) return;
  UNIEP_CHECK(w != nullptr && q != nullptr && scales != nullptr,
              "w, q and scales must not be null, got w ", w == nullptr ? "null" : "set", ", q ",
              q == nullptr ? "null" : "set", ", scales ", scales == nullptr ? "null" : "set");
  const int64_t kb = k / kBlock, nb = n / kBlock;
  for (int64_t e = 0; e < experts; ++e) {
    const uint16_t* we = w + e * k * n;
    uint8_t* qe = q + e * n * k;
    for (int64_t bk = 0; bk < kb; ++bk)
      for (int64_t bn = 0; bn < nb; ++bn) {
        float amax = 0.0f;
        for (int64_t r = bk * kBlock; r < (bk + 1) * kBlock; ++r)
          for (int64_t c = bn * kBlock; c < (bn + 1) * kBlock; ++c)
            amax = std::max(amax, std::fabs(numeric::bf16_to_float({we[r * n + c]})));
        const numeric::Fp8BlockScale s = numeric::fp8_block_scale(amax);
        scales[(e * kb + bk) * nb + bn] = s.scale;
        for (int64_t r = bk * kBlock; r < (bk + 1) * kBlock; ++r)
          for (int64_t c = bn * kBlock; c < (bn + 1) * kBlock; ++c)
            qe[c * k + r] = numeric::float_to_e4m3(numeric::bf16_to_float({we[r * n + c]}) * s.inv);
      }
  }
}

int64_t gate_up_source_row(int64_t packed_row, int64_t ffn) {
  check_ffn(ffn);
  UNIEP_CHECK(packed_row >= 0 && packed_row < 2 * ffn,
              "packed_row must be in [0, 2 ffn = ", 2 * ffn, "), got ", packed_row);
  const int64_t c = packed_row % kHalf, g = (packed_row / kHalf) % 2, j = packed_row / (2 * kHalf);
  return g * ffn + kHalf * j + c;
}

int64_t gate_up_source_block(int64_t packed_group, int64_t ffn) {
  check_ffn(ffn);
  UNIEP_CHECK(packed_group >= 0 && packed_group < 2 * ffn / kHalf,
              "packed_group must be in [0, 2 ffn / 64 = ", 2 * ffn / kHalf, "), got ",
              packed_group);
  return gate_up_source_row(packed_group * kHalf, ffn) / kBlock;
}

void pack_gate_up_fp8(const uint8_t* q1, const float* s1, int64_t experts, int64_t ffn, int64_t k,
                      uint8_t* q, float* s) {
  check_ffn(ffn);
  check_sizes(experts, k, 2 * ffn, "k", "2 ffn");
  if (experts == 0) return;
  UNIEP_CHECK(q1 != nullptr && s1 != nullptr && q != nullptr && s != nullptr,
              "q1, s1, q and s must not be null");
  const int64_t n = 2 * ffn, kb = k / kBlock, groups = n / kHalf;
  // The row map once for every expert (each lookup checks its arguments).
  std::vector<int64_t> rows(static_cast<size_t>(n)), blocks(static_cast<size_t>(groups));
  for (int64_t p = 0; p < n; ++p) rows[static_cast<size_t>(p)] = gate_up_source_row(p, ffn);
  for (int64_t g = 0; g < groups; ++g)
    blocks[static_cast<size_t>(g)] = gate_up_source_block(g, ffn);
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t p = 0; p < n; ++p)
      std::memcpy(q + (e * n + p) * k, q1 + (e * n + rows[static_cast<size_t>(p)]) * k,
                  static_cast<size_t>(k));
    for (int64_t bk = 0; bk < kb; ++bk)
      for (int64_t g = 0; g < groups; ++g)
        s[(e * kb + bk) * groups + g] =
            s1[(e * kb + bk) * (n / kBlock) + blocks[static_cast<size_t>(g)]];
  }
}

}  // namespace uniep
