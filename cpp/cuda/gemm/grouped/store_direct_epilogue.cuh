// The plain product stored straight from the fp32 accumulators: out[m, n] = bf16(acc), two
// adjacent columns a 4-byte store, no shared memory (so the mainloop keeps all of it for its
// stages) and no barrier between the consumer warps. CUTLASS's TMA store epilogue instead stages
// each subtile in shared memory behind a named barrier, while the tile's tensor cores idle; on a
// short K (16 k-blocks) that is a visible share of a tile's time.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::grouped {

class StoreDirectEpilogue : public DirectStoreEpilogue {
 public:
  struct Arguments {
    Bf16** ptr_out = nullptr;  // per group: row 0 of its rows of out, [M, N] row-major
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(const ProblemShape&, const Arguments& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const Arguments& args) {
    return args.ptr_out != nullptr;
  }

  CUTLASS_HOST_DEVICE explicit StoreDirectEpilogue(const Params& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 const cute::Tensor<FrgEngine, FrgLayout>& acc, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kAtom = size<0>(FrgLayout{});
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    Tensor crd = fragment_coords<FrgLayout>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl,
                                            tiled_mma, thread_idx);
    auto* out = reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[get<3>(blk_coord_mnkl)]);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kAtom; v += 2) {  // (column pair, row half, 8-column block)
        const auto c = crd(i + v);
        const int m = get<0>(c), n = get<1>(c);
        if (m >= M || n >= N) continue;
        *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(m) * N + n) =
            pack(acc(i + v), acc(i + v + 1));
      }
    }
  }

 private:
  Params params_;
};

}  // namespace uniep::cuda::grouped
