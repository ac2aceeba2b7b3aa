// The data-gradient GEMM's SwiGLU-backward epilogue: the experts' backward computes
// grad_act = grad_out_rows w2[e]^T (kDgrad) and applies SwiGLU's backward to it straight from
// the fp32 accumulators, so grad_act never reaches memory and no element-wise pass follows.
//
// Per output value (row m of the expert, column j < I), from h's gate and up (h [R, 2I], the
// forward's first product) and the row's routing weight w[r]:
//   ga = bf16(acc)   the bits the unfused chain stored as grad_act
//   act_w[r, j], grad_h[r, j], grad_h[r, I + j]   swiglu_backward_values (swiglu_backward_math.cuh)
//   dot_parts[r, j / 128] = sum of act * ga over the row's 128-column chunk
// The chunk's sum has one order whatever the tile: lane q of a row's quad (lanes 4r..4r+3)
// adds the 8 columns of blocks q, q + 4, q + 8, q + 12 of the chunk in that order, then the
// quad's four partials are summed by a fixed butterfly. Chunks of 128 columns, not tiles, so a
// 128- or 256-wide tile gives the same partials; sum_row_parts adds a row's chunks in ascending
// order.
//
// No shared memory (the mainloop keeps all of it for its stages): a WGMMA fragment gives each
// lane two adjacent columns of every 8-column block, so the quad trades grad_act pairs
// (transpose4) until each lane holds whole blocks, and h, act_w and grad_h move in 16-byte
// accesses, whole sectors, instead of 4-byte ones (which took 1.3-1.6x the two launches' time).
#pragma once

#include <cuda_bf16.h>

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/swiglu_backward_math.cuh"

namespace uniep::cuda::grouped {

constexpr int kDotChunk = 128;  // columns per partial dot

class SwiGluBackwardEpilogue : public DirectStoreEpilogue {
 public:
  struct Arguments {
    Bf16** ptr_out = nullptr;        // per group: its first row of act_w (the problem kernel's D)
    const Bf16* act_w = nullptr;     // row 0 of act_w [R, I]: a group's first row is
                                     // (ptr_out[group] - act_w) / ffn
    const Bf16* h = nullptr;         // [R, 2I]: gate columns [0, I), up columns [I, 2I)
    Bf16* grad_h = nullptr;          // [R, 2I], h's layout
    const float* w = nullptr;        // [R]: each row's routing weight
    float* dot_parts = nullptr;      // [R, chunks]
    int64_t ffn = 0;                 // I
    int64_t chunks = 0;              // ceil(I / kDotChunk)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(const ProblemShape&, const Arguments& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const Arguments& a) {
    return a.ptr_out != nullptr && a.act_w != nullptr && a.h != nullptr && a.grad_h != nullptr &&
           a.w != nullptr && a.dot_parts != nullptr && a.ffn > 0 && a.ffn % 2 == 0 &&
           a.chunks == (a.ffn + kDotChunk - 1) / kDotChunk;
  }

  CUTLASS_HOST_DEVICE explicit SwiGluBackwardEpilogue(const Params& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 const cute::Tensor<FrgEngine, FrgLayout>& acc, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kAtom = size<0>(FrgLayout{});
    constexpr int kBlocks = kAtom / 4;  // 8-column blocks of the atom
    constexpr int kChunkBlocks = kDotChunk / 8;
    static_assert(kBlocks % kChunkBlocks == 0,
                  "an accumulator atom must span whole 128-column chunks");
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const int group = static_cast<int>(get<3>(blk_coord_mnkl));
    Tensor crd = fragment_coords<FrgLayout>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl,
                                            tiled_mma, thread_idx);
    const int64_t ffn = params_.ffn;
    const int64_t row0 = (params_.ptr_out[group] - params_.act_w) / ffn;
    const int q = static_cast<int>(threadIdx.x % 4);

    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {  // the thread's two rows, 8 apart
        const int m = get<0>(crd(i + 2 * half));
        const bool row_ok = m < M;
        const int64_t r = row0 + m;
        const float wr = row_ok ? params_.w[r] : 0.0f;
        const auto* hr = reinterpret_cast<const __nv_bfloat16*>(params_.h) + r * 2 * ffn;
        auto* gr = reinterpret_cast<__nv_bfloat16*>(params_.grad_h) + r * 2 * ffn;
        auto* ar = reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[group]) + int64_t(m) * ffn;
        CUTLASS_PRAGMA_UNROLL
        for (int chunk = 0; chunk < kBlocks / kChunkBlocks; ++chunk) {
          constexpr int kQuads = kChunkBlocks / 4;
          // The chunk's h first, every load in flight at once (read-only path): issued one
          // block at a time, behind the stores of the block before, each waited a round trip.
          int cols[kQuads];
          uint4 g8[kQuads], u8[kQuads];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kQuads; ++j) {
            const int quad = chunk * kQuads + j;
            cols[j] = get<1>(crd(i + 4 * (4 * quad) + 2 * half)) - 2 * q + 8 * q;
            const bool ok = row_ok && cols[j] < N;
            g8[j] = ok ? __ldg(reinterpret_cast<const uint4*>(hr + cols[j])) : uint4{};
            u8[j] = ok ? __ldg(reinterpret_cast<const uint4*>(hr + ffn + cols[j])) : uint4{};
          }
          float dot = 0.0f;
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kQuads; ++j) {
            const int quad = chunk * kQuads + j;
            // grad_act rounded to bf16 (the bits a stored grad_act has), then the four lanes of
            // the row trade pairs so that lane q holds all 8 columns of block 4 quad + q.
            uint32_t ga[4];
            CUTLASS_PRAGMA_UNROLL
            for (int t = 0; t < 4; ++t) {
              const int v = 4 * (4 * quad + t) + 2 * half;
              ga[t] = pack(acc(i + v), acc(i + v + 1));
            }
            transpose4(ga, q);
            const int n = cols[j];
            if (!row_ok || n >= N) continue;
            const auto* gv = reinterpret_cast<const __nv_bfloat162*>(&g8[j]);
            const auto* uv = reinterpret_cast<const __nv_bfloat162*>(&u8[j]);
            uint32_t act_w[4], grad_g[4], grad_u[4];
            CUTLASS_PRAGMA_UNROLL
            for (int t = 0; t < 4; ++t) {
              const __nv_bfloat162 a2 = *reinterpret_cast<const __nv_bfloat162*>(&ga[t]);
              const float ga0 = __low2float(a2), ga1 = __high2float(a2);
              const SwiGluBackwardValues b0 =
                  swiglu_backward_values(__low2float(gv[t]), __low2float(uv[t]), ga0, wr);
              const SwiGluBackwardValues b1 =
                  swiglu_backward_values(__high2float(gv[t]), __high2float(uv[t]), ga1, wr);
              dot = __fadd_rn(dot, __fmul_rn(b0.act, ga0));
              dot = __fadd_rn(dot, __fmul_rn(b1.act, ga1));
              act_w[t] = pack(b0.act_w, b1.act_w);
              grad_g[t] = pack(b0.grad_g, b1.grad_g);
              grad_u[t] = pack(b0.grad_u, b1.grad_u);
            }
            store16(ar + n, act_w);
            store16(gr + n, grad_g);
            store16(gr + ffn + n, grad_u);
          }
          // The quad's partials, (q0 + q1) + (q2 + q3) on every lane (fp32 addition commutes).
          dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, 1));
          dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, 2));
          const int n0 = get<1>(crd(i + 4 * chunk * kChunkBlocks + 2 * half)) - 2 * q;
          if (q == 0 && row_ok && n0 < N)
            params_.dot_parts[r * params_.chunks + n0 / kDotChunk] = dot;
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace uniep::cuda::grouped
