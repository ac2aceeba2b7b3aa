// The data-gradient GEMM's SwiGLU-backward epilogue: the experts' backward computes
// grad_act = grad_out_rows w2[e]^T (kDgrad) and applies SwiGLU's backward to it straight from
// the fp32 accumulators, so grad_act never reaches memory and no element-wise pass follows.
//
// Per output value (row m of the expert, column j < I), from h's gate and up (h [R, 2I], the
// forward's first product) and the row's routing weight w[r]:
//   ga = bf16(acc)   the bits the unfused chain stored as grad_act
//   act_w[r, j], grad_h[r, j], grad_h[r, I + j]   swiglu_backward_values (swiglu_backward_math.cuh)
//   dot_parts[r, j / 128] = sum of act * ga over the row's 128-column chunk
// The chunk's sum has one order whatever the tile: each lane of a row's quad (lanes 4r..4r+3)
// adds its two columns of every 8-column block in ascending block order, then the quad's four
// partials are summed by a fixed butterfly. Chunks of 128 columns, not tiles, so a 128- or
// 256-wide tile gives the same partials; sum_row_parts adds a row's chunks in ascending order.
//
// Direct 4-byte loads and stores from the accumulator fragment (two adjacent columns per
// thread), no shared memory: the mainloop keeps all of it for its stages.
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
    const bool lead = threadIdx.x % 4 == 0;

    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {  // the thread's two rows, 8 apart
        const auto first = crd(i + 2 * half);
        const int m = get<0>(first);
        const bool row_ok = m < M;
        const int64_t r = row0 + m;
        const float wr = row_ok ? params_.w[r] : 0.0f;
        const auto* hr = reinterpret_cast<const __nv_bfloat16*>(params_.h) + r * 2 * ffn;
        __nv_bfloat16* gr = reinterpret_cast<__nv_bfloat16*>(params_.grad_h) + r * 2 * ffn;
        __nv_bfloat16* ar =
            reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[group]) + int64_t(m) * ffn;
        CUTLASS_PRAGMA_UNROLL
        for (int chunk = 0; chunk < kBlocks / kChunkBlocks; ++chunk) {
          float dot = 0.0f;
          CUTLASS_PRAGMA_UNROLL
          for (int b = chunk * kChunkBlocks; b < (chunk + 1) * kChunkBlocks; ++b) {
            const int v = 4 * b + 2 * half;  // column pair (n, n + 1) of block b
            const int n = get<1>(crd(i + v));
            if (!row_ok || n >= N) continue;
            const float ga0 = __bfloat162float(__float2bfloat16_rn(acc(i + v)));
            const float ga1 = __bfloat162float(__float2bfloat16_rn(acc(i + v + 1)));
            const __nv_bfloat162 g2 = *reinterpret_cast<const __nv_bfloat162*>(hr + n);
            const __nv_bfloat162 u2 = *reinterpret_cast<const __nv_bfloat162*>(hr + ffn + n);
            const SwiGluBackwardValues b0 = swiglu_backward_values(
                __low2float(g2), __low2float(u2), ga0, wr);
            const SwiGluBackwardValues b1 = swiglu_backward_values(
                __high2float(g2), __high2float(u2), ga1, wr);
            dot = __fadd_rn(dot, __fmul_rn(b0.act, ga0));
            dot = __fadd_rn(dot, __fmul_rn(b1.act, ga1));
            *reinterpret_cast<__nv_bfloat162*>(ar + n) =
                __floats2bfloat162_rn(b0.act_w, b1.act_w);
            *reinterpret_cast<__nv_bfloat162*>(gr + n) =
                __floats2bfloat162_rn(b0.grad_g, b1.grad_g);
            *reinterpret_cast<__nv_bfloat162*>(gr + ffn + n) =
                __floats2bfloat162_rn(b0.grad_u, b1.grad_u);
          }
          // The quad's partials, (q0 + q1) + (q2 + q3) on every lane (fp32 addition commutes).
          dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, 1));
          dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, 2));
          // The lead lane's first column is the chunk's first.
          const int n0 = get<1>(crd(i + 4 * chunk * kChunkBlocks + 2 * half));
          if (lead && row_ok && n0 < N)
            params_.dot_parts[r * params_.chunks + n0 / kDotChunk] = dot;
        }
      }
    }
  }

 private:
  Params params_;
};

}  // namespace uniep::cuda::grouped
