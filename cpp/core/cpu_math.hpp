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
      for (int64_t i = 0; i < experts * rows * cols; ++i) dst[i] = numeric::Storage<S>::load(src[i]);
      return;
    }
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          *dst++ = numeric::Storage<S>::load(src[e * s.expert + r * s.row + c * s.col]);
  }
  const Acc* up(int64_t e) const { return &w1[e * H * 2 * I]; }
  const Acc* down(int64_t e) const { return &w2[e * I * H]; }
};

// The forward of one row, rounding where a GPU grouped GEMM writes its output in storage type:
// h = x W1 (rounded), act = silu(gate) * up (rounded), y = act W2 (rounded).
template <typename S>
struct RowForward {
  using St = numeric::Storage<S>;
  using Acc = typename St::Acc;
  std::vector<Acc> x, h, act, y;

  RowForward(int64_t H, int64_t I) : x(H), h(2 * I), act(I), y(H) {}

  void run(const S* xrow, const ExpertWeights<S>& w, int64_t e, int64_t tile_n, int64_t tile_k) {
    const int64_t H = w.H, I = w.I;
    for (int64_t i = 0; i < H; ++i) x[i] = St::load(xrow[i]);
    vec_mat(x.data(), H, w.up(e), 2 * I, tile_n, tile_k, h.data());
    for (auto& v : h) v = St::load(St::store(v));
    for (int64_t i = 0; i < I; ++i) {
      const Acc g = h[i];
      act[i] = St::load(St::store(g * sigmoid(g) * h[I + i]));
    }
    vec_mat(act.data(), I, w.down(e), H, tile_n, tile_k, y.data());
    for (auto& v : y) v = St::load(St::store(v));
  }
};

}  // namespace uniep::cpu
