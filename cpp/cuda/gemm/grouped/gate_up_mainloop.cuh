// The first expert GEMM's mainloop on w1 as the module stores it ([E, K, 2I]: gate columns
// [0, I), up columns [I, 2I)), for the SwiGLU epilogue without a packed copy of w1.
//
// Why: the SwiGLU epilogue needs gate column j and up column j in one thread's accumulators,
// which hold two adjacent columns of every block of 8 across the whole tile width. Packing w1 in
// blocks of 8 (pack_gate_up) does it, but the packed copy costs a pass over w1 whenever the
// weights change, every training step; without it moe_forward stored h [R, 2I] and ran SwiGLU
// as a pass of its own. Here B's TMA reads w1 as if packed in blocks of 64 instead: packed
// column p = c + 64 g + 128 j (c < 64, g = 0 gate or 1 up, j < I / 64) is w1's column
// g I + 64 j + c. That is only a different view of the same bytes: B's N mode becomes the
// hierarchical (64, 2, I / 64) : (1, I, 64), whose innermost 64 elements (128 bytes, the
// swizzle's width) stay contiguous, so the TMA box and the shared-memory tile are the ones the
// packed layout has. Gate column c and up column c then sit 64 tile columns (8 blocks) apart,
// still in one thread (SwiGluEpilogue<64>).
//
// How: CUTLASS's ptr-array mainloop builds B's TMA from a flat (N, K) shape of dynamic sizes and
// rewrites its descriptor per group; CuTe's TMA needs the sub-mode sizes 64 and 2 static. So this
// wrapper keeps a TMA of its own in Params over all E experts at once (the group index is the
// expert: the problem kernel gives group e expert e's weight) and hides the base's load() to issue
// B from it, for the group GroupTrackingMainloop (group_mainloop.cuh) remembers, as GatedMainloop
// does. A, the pipeline, the consumers and the tile scheduler are the base's. The base still swaps
// its own B descriptor per group: harmless, ptr_B stays valid, and the groups below plain_groups
// never read it, while those at or past it (the fused MoE kernel's GEMM 2) load B through it as
// the base does.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include <climits>
#include <cstdint>

#include "cuda/gemm/grouped/group_mainloop.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::grouped {

template <class Base>
struct PlainGateUpMainloop : GroupTrackingMainloop<Base> {
  using Tracking = GroupTrackingMainloop<Base>;
  using TileShape = typename Base::TileShape;
  using ClusterShapeMNK = typename Base::DispatchPolicy::ClusterShape;
  using ElementB = typename Base::InternalElementB;
  static constexpr int kTileN = cute::size<1>(TileShape{});
  // A tile holds whole (gate, up) pairs of 64-column blocks: tile_n / 128 of them.
  static_assert(kTileN % 128 == 0, "a tile must cover whole 64-column gate/up block pairs");

  // ((c, g, j), k, e) -> element of w1 [E, K, 2I].
  using GmemShape = cute::Shape<cute::Shape<cute::_64, cute::_2, int32_t>, int32_t, int32_t>;
  using GmemStride = cute::Stride<cute::Stride<cute::_1, int64_t, cute::_64>, int64_t, int64_t>;

  static auto gmem_layout(int32_t ffn, int32_t hidden, int32_t experts) {
    using namespace cute;
    const int64_t i = ffn;
    return make_layout(GmemShape{make_shape(_64{}, _2{}, ffn / 64), hidden, experts},
                       GmemStride{make_stride(_1{}, i, _64{}), 2 * i, 2 * i * hidden});
  }

  template <class Tensor>
  static auto make_tma(const Tensor& w1) {
    using namespace cute;
    return make_tma_copy(typename Base::GmemTiledCopyB{}, w1,
                         typename Base::SmemLayoutB{}(_, _, Int<0>{}),
                         make_shape(shape<1>(TileShape{}), shape<2>(TileShape{})),
                         size<0>(ClusterShapeMNK{}));  // multicast along M, as the base's B
  }
  using TmaB = decltype(make_tma(
      cute::make_tensor(static_cast<const ElementB*>(nullptr), gmem_layout(64, 1, 1))));

  struct Arguments : Base::Arguments {
    const void* w1 = nullptr;  // [E, K, 2I] bf16, gate then up columns
    int32_t ffn = 0;           // I: a multiple of tile_n / 2
    int32_t hidden = 0;        // K
    int32_t experts = 0;       // E: the groups that read w1
    // Groups at or past it load B as the base does, from their own pointers (the fused MoE
    // kernel's GEMM 2 groups, which follow its E GEMM 1 groups).
    int32_t plain_groups = INT32_MAX;
  };
  struct Params : Base::Params {
    TmaB tma_w1;
    int32_t ffn = 0, hidden = 0, experts = 0, plain_groups = INT32_MAX;
  };

  // Every caller's w1 arguments: experts E read w1 as stored; groups from plain_groups on load
  // B from their own pointers.
  static void set_w1(Arguments& args, const PlainW1& plain, int64_t experts,
                     int64_t plain_groups = INT32_MAX) {
    args.w1 = plain.w1;
    args.ffn = static_cast<int32_t>(plain.n / 2);
    args.hidden = static_cast<int32_t>(plain.k);
    args.experts = static_cast<int32_t>(experts);
    args.plain_groups = static_cast<int32_t>(plain_groups);
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, const Arguments& args,
                                        void* workspace) {
    Params p = Tracking::template base_params<Params>(problem_shapes, args, workspace);
    const auto* w1 = static_cast<const ElementB*>(args.w1);
    p.tma_w1 = make_tma(cute::make_tensor(w1, gmem_layout(args.ffn, args.hidden, args.experts)));
    p.ffn = args.ffn;
    p.hidden = args.hidden;
    p.experts = args.experts;
    p.plain_groups = args.plain_groups;
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(const ProblemShape& problem_shapes, const Arguments& args) {
    return args.w1 != nullptr && args.ffn > 0 && args.ffn % (kTileN / 2) == 0 && args.hidden > 0 &&
           args.experts > 0 && Base::can_implement(problem_shapes, args);
  }

  // The base's load() with B from tma_w1: the same pipeline stages, barrier and transaction bytes
  // (the box is the base's B box), B multicast along M as the base's.
  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(const Params& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           const cute::tuple<TensorA, TensorB>& load_inputs,
                           const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps,
                           const BlockCoord& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    if (this->group_ >= params.plain_groups) {
      Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord,
                 k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
      return;
    }
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    constexpr uint32_t cluster_m = size<0>(ClusterShapeMNK{});
    const uint32_t block_m = block_rank_in_cluster % cluster_m;
    const uint32_t block_n = block_rank_in_cluster / cluster_m;

    const auto m_coord = get<0>(blk_coord);
    const auto n_coord = get<1>(blk_coord);
    Tensor gA = get<0>(load_inputs)(_, _, m_coord, _, get<3>(blk_coord));  // (BLK_M, BLK_K, k)
    // All experts' w1 in one tensor: the group is the expert.
    Tensor mB = params.tma_w1.get_tma_tensor(
        make_shape(make_shape(_64{}, _2{}, params.ffn / 64), params.hidden, params.experts));
    Tensor gB_nkl = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<Underscore, _1, _1>{});
    Tensor gB = gB_nkl(_, _, n_coord, _, this->group_);  // (BLK_N, BLK_K, k)

    auto block_tma_a = params.tma_load_a.get_slice(block_n);
    auto block_tma_b = params.tma_w1.get_slice(block_m);
    Tensor tAgA = block_tma_a.partition_S(gA);
    Tensor tAsA = block_tma_a.partition_D(sA);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);

    // A is shared along N within the cluster, B along M (the base's masks).
    auto block_layout = Layout<ClusterShapeMNK>{};  // (m, n) -> block id
    uint16_t mask_a = 0, mask_b = 0;
    if constexpr (is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      for (int n = 0; n < size<1>(block_layout); ++n)
        mask_a |= uint16_t(1) << block_layout(block_m, n, Int<0>{});
    }
    if constexpr (is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mask_b |= uint16_t(1) << block_layout(m, block_n, Int<0>{});
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(get<0>(input_tensormaps), *barrier, mask_a),
           tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(params.tma_w1.with(*barrier, mask_b), tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace uniep::cuda::grouped
