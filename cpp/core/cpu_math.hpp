// Expert arithmetic of the CPU executor. Every output element accumulates its products in
// ascending k, whatever the tile sizes, so the tiling from TuningParams never changes a bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/numeric.hpp"
#include "uniep/cpu_executor.hpp"

namespace uniep::cpu {

// c[n] = sum_k a[k] * B[k * N + n], k ascending, blocked by tile_n x tile_k.
template <typename Acc>
void vec_mat(const Acc* a, int64_t Kd, const Acc* B, int64_t N, int64_t tile_n, int64_t tile_k,
             Acc* c) {
  for (int64_t n0 = 0; n0 < N; n0 += tile_n) {
    const int64_t n1 = std::min(N, n0 + tile_n);
    for (int64_t n = n0; n < n1; ++n) c[n] = Acc(0);
    for (int64_t k0 = 0; k0 < Kd; k0 += tile_k) {
      const int64_t k1 = std::min(Kd, k0 + tile_k);
      for (int64_t k = k0; k < k1; ++k) {
        const Acc av = a[k];
        const Acc* b = B + k * N;
        for (int64_t n = n0; n < n1; ++n) c[n] += av * b[n];
      }
    }
  }
}

// c[m] = sum_n a[n] * B[m * N + n]: a vector times the transpose of a row-major [M, N] matrix.
template <typename Acc>
void vec_mat_t(const Acc* a, const Acc* B, int64_t M, int64_t N, Acc* c) {
  for (int64_t m = 0; m < M; ++m) {
    const Acc* b = B + m * N;
    Acc s = Acc(0);
    for (int64_t n = 0; n < N; ++n) s += a[n] * b[n];
    c[m] = s;
  }
}

template <typename Acc>
Acc sigmoid(Acc g) {
  return Acc(1) / (Acc(1) + std::exp(-g));
}

// Rounds values to e4m3 with one fp32 scale per block (numeric::fp8_block_scale), as the fp8
// dispatch (cpu_wire.hpp) and uniep.gemm quantize, and leaves them dequantized (the e4m3 value
// times the scale): what an fp8 GEMM multiplies. `at(i)` gives the i-th value of the block.
template <typename Acc, typename At>
void fp8_round_block(int64_t count, At at) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i) amax = std::max(amax, std::fabs(float(at(i))));
  const numeric::Fp8BlockScale s = numeric::fp8_block_scale(amax);
  for (int64_t i = 0; i < count; ++i) {
    Acc& v = at(i);
    v = Acc(numeric::e4m3_to_float(numeric::float_to_e4m3(float(v) * s.inv)) * s.scale);
  }
}

// Local expert weights widened once to the accumulation type, read through their strides (this
// copy is the one the executor makes anyway, so strided weights cost nothing more).
template <typename S>
struct ExpertWeights {
  using Acc = typename numeric::Storage<S>::Acc;
  int64_t H, I;
  std::vector<Acc> w1, w2;  // [E_local][H][2I], [E_local][I][H]

  ExpertWeights(const S* w1s, const S* w2s, int64_t experts, int64_t hidden, int64_t ffn,
                const WeightStrides& s1 = {}, const WeightStrides& s2 = {})
      : H(hidden), I(ffn), w1(experts * hidden * 2 * ffn), w2(experts * ffn * hidden) {
    widen(w1s, experts, hidden, 2 * ffn, s1, w1.data());
    widen(w2s, experts, ffn, hidden, s2, w2.data());
  }
  static void widen(const S* src, int64_t experts, int64_t rows, int64_t cols,
                    const WeightStrides& s, Acc* dst) {
    if (s.contiguous()) {
      for (int64_t i = 0; i < experts * rows * cols; ++i)
        dst[i] = numeric::Storage<S>::load(src[i]);
      return;
    }
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          *dst++ = numeric::Storage<S>::load(src[e * s.expert + r * s.row + c * s.col]);
  }
  const Acc* up(int64_t e) const { return &w1[e * H * 2 * I]; }
  const Acc* down(int64_t e) const { return &w2[e * I * H]; }

  // fp8 experts: each [rows, cols] matrix rounded in 128 x 128 blocks (rows and cols multiples
  // of 128: check_expert_precision), as uniep.gemm.quantize_expert_weights does on CUDA.
  void round_to_fp8_blocks() {
    round_blocks(w1.data(), w1.size() / (H * 2 * I), H, 2 * I);
    round_blocks(w2.data(), w2.size() / (I * H), I, H);
  }
  static void round_blocks(Acc* w, int64_t experts, int64_t rows, int64_t cols) {
    constexpr int64_t B = numeric::kFp8BlockCols;
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r0 = 0; r0 < rows; r0 += B)
        for (int64_t c0 = 0; c0 < cols; c0 += B) {
          Acc* block = w + (e * rows + r0) * cols + c0;
          fp8_round_block<Acc>(B * B, [&](int64_t i) -> Acc& {
            return block[(i / B) * cols + i % B];
          });
        }
  }
};

// The forward of one row, rounding where a GPU grouped GEMM writes its output in storage type:
// h = x W1 (rounded), act = silu(gate) * up (rounded), y = act W2 (rounded, unless round_y is
// false: combine=rank_partials sums the second product's fp32 outputs). With fp8 experts
// (the weights already rounded: ExpertWeights::round_to_fp8_blocks) act is also rounded to e4m3
// in 1 x 128 blocks before the second product, as the fp8 path's SwiGLU pass quantizes it.
template <typename S>
struct RowForward {
  using St = numeric::Storage<S>;
  using Acc = typename St::Acc;
  std::vector<Acc> x, h, act, y;

  bool fp8_act = false;
  bool round_y = true;

  RowForward(int64_t H, int64_t I, bool fp8 = false, bool round_y = true)
      : x(H), h(2 * I), act(I), y(H), fp8_act(fp8), round_y(round_y) {}

  void run(const S* xrow, const ExpertWeights<S>& w, int64_t e, int64_t tile_n, int64_t tile_k) {
    for (int64_t i = 0; i < w.H; ++i) x[i] = St::load(xrow[i]);
    run_loaded(w, e, tile_n, tile_k);
  }

  // The same on the row already in `x` (fp8 experts load it unrounded: the e4m3 value times its
  // block scale, as the fp8 GEMM multiplies it).
  void run_loaded(const ExpertWeights<S>& w, int64_t e, int64_t tile_n, int64_t tile_k) {
    const int64_t H = w.H, I = w.I;
    vec_mat(x.data(), H, w.up(e), 2 * I, tile_n, tile_k, h.data());
    for (auto& v : h) v = St::load(St::store(v));
    for (int64_t i = 0; i < I; ++i) {
      const Acc g = h[i];
      act[i] = St::load(St::store(g * sigmoid(g) * h[I + i]));
    }
    if (fp8_act) {
      for (int64_t c0 = 0; c0 < I; c0 += numeric::kFp8BlockCols)
        fp8_round_block<Acc>(std::min<int64_t>(numeric::kFp8BlockCols, I - c0),
                             [&](int64_t i) -> Acc& { return act[c0 + i]; });
    }
    vec_mat(act.data(), I, w.down(e), H, tile_n, tile_k, y.data());
    if (round_y)
      for (auto& v : y) v = St::load(St::store(v));
  }
};

}  // namespace uniep::cpu
