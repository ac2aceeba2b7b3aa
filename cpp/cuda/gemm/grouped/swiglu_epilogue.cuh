// The grouped GEMM's SwiGLU epilogue: out[m, j] = silu(gate[m, j]) * up[m, j] straight from the
// fp32 accumulators of the first expert GEMM, so the [R, 2I] product never reaches memory.
//
// Why this layout of w1: the pair (gate j, up j) must sit in one thread's accumulators. A WGMMA
// accumulator gives each thread two adjacent columns in every block of 8 (c, c + 1, then c + 8,
// c + 9, ...), so w1's columns are interleaved in blocks of 8: columns [16b, 16b + 8) hold gate
// j = 8b..8b+7 and [16b + 8, 16b + 16) hold up for the same j (pack_gate_up in
// include/uniep/cuda/grouped_gemm.hpp describes it). Column c of a gate block pairs with column
// c + 8, the value four places on in the thread's fragment, and every thread writes act for two
// adjacent columns (one 4-byte store); no shared memory, no shuffle.
//
// Numerics are those of the unfused chain and of the CPU executor: gate and up rounded to bf16
// (where the chain stored h), silu(g) * u in fp32, rounded once to bf16.
//
// The interface CUTLASS asks of it is DirectStoreEpilogue's (direct_epilogue.cuh).
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/megakernel/tile_gate.cuh"

namespace uniep::cuda::grouped {

class SwiGluEpilogue : public DirectStoreEpilogue {
 public:
  struct Arguments {
    Bf16** ptr_out = nullptr;  // per group: row 0 of its rows of out
    int64_t ld_out = 0;        // elements between rows of out (I)
    // Optional (the MegaKernel's second GEMM waits on it, docs/megakernel.md): once a warp has
    // written its part of output tile (expert e, m-tile i), it adds 1 to
    // done[done_base[e] + i], so the tile's activation rows are complete at
    // (consumer warps per tile) x (N-tiles) arrivals. Null: no signal.
    uint32_t* done = nullptr;
    const int32_t* done_base = nullptr;
    int64_t num_done = 0;  // entries of done; a tile outside them is not signalled
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(const ProblemShape&, const Arguments& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const Arguments& args) {
    return args.ptr_out != nullptr && args.ld_out > 0 && args.ld_out % 2 == 0;
  }

  CUTLASS_HOST_DEVICE explicit SwiGluEpilogue(const Params& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 const cute::Tensor<FrgEngine, FrgLayout>& acc, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kAtom = size<0>(FrgLayout{});
    static_assert(kAtom % 8 == 0, "column blocks must pair up (gate, up)");
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const auto m_coord = get<0>(blk_coord_mnkl);
    const auto l_coord = get<3>(blk_coord_mnkl);
    Tensor crd = fragment_coords<FrgLayout>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl,
                                            tiled_mma, thread_idx);
    Bf16* out = params_.ptr_out[l_coord];
    const int64_t ld = params_.ld_out;

    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kAtom; ++v) {
        // v = column + 2 * row half + 4 * column block; gate blocks are the even ones.
        if ((v / 4) % 2 != 0 || v % 2 != 0) continue;
        const auto c = crd(i + v);
        const int m = get<0>(c), n = get<1>(c);
        if (m >= M || n >= N) continue;
        const float act0 = swiglu(acc(i + v), acc(i + v + 4));
        const float act1 = swiglu(acc(i + v + 1), acc(i + v + 5));
        // n is in a gate block [16b, 16b + 8): its act column is 8b + n % 16.
        const int64_t j = (n / 16) * 8 + n % 16;
        __nv_bfloat162 pair = __floats2bfloat162_rn(act0, act1);
        *reinterpret_cast<__nv_bfloat162*>(reinterpret_cast<__nv_bfloat16*>(out) + m * ld + j) =
            pair;
      }
    }
    signal_tile_done(params_.done, params_.done_base, static_cast<int>(l_coord),
                     static_cast<int>(m_coord), size<0>(blk_shape_mnk), M, params_.num_done);
  }

 private:
  Params params_;
};

}  // namespace uniep::cuda::grouped
