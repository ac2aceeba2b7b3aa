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
// B from it. The kernel hands load() a batch coordinate of 0 (its groups have their own
// descriptors), so the wrapper takes the group from tensormaps_perform_update, which the producer
// calls for its first group and at every change of group, as GatedMainloop does. A, the pipeline,
// the consumers and the tile scheduler are the base's. The base still swaps its own B descriptor
// per group: harmless, ptr_B stays valid, and the groups below plain_groups never read it, while
// those at or past it (the fused MoE kernel's GEMM 2) load B through it as the base does.
//
// Gathered rows (Arguments::gather, GroupedGemmProblem::row_slot): A's rows can come straight
// from a dispatch's receive slots, GEMM row r of expert e being slot row_slot[r], with no gather
// pass writing the [R, K] rows first (on a DeepSeek-V3 EP8 rank that pass moved 0.94 GB, 234 us
// of a 5.3 ms layer on an H200). Hopper's tensor copies have no gather, and one tensor copy per
// row was measured 4.5-5.3x slower than the whole GEMM on contiguous rows (the copy engine takes
// tens of cycles per instruction, and a stage needs one per row). So the producer warp's 32
// lanes copy A with cp.async instead, 16 bytes each, 8 lanes per row (128-byte coalesced
// segments), into the swizzled stage at the addresses the consumers read. B still comes by its
// tensor copy. The stage's barrier then completes on three things: the leader's arrival (with
// the usual A + B transaction bytes), B's bytes, and each lane's cp.async arrival, which holds
// the phase open until that lane's copies have landed; A's bytes are marked complete by hand
// once every lane has registered its copies. Rows past the expert's end, slots outside x and
// columns past K read zeros. The pipeline and consumers are the base's, so the bits are those of
// the gathered rows. With a cluster along N each CTA copies its whole A (no multicast).
#pragma once

#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include <climits>
#include <cstdint>

#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::grouped {

template <class Base>
struct PlainGateUpMainloop : Base {
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
  using TmaB = decltype(make_tma(cute::make_tensor(static_cast<const ElementB*>(nullptr),
                                                    gmem_layout(64, 1, 1))));

  // Gathered rows: the producer warp copies 4 rows of 64 columns per pass, 8 lanes per row; lane
  // l keeps the slots of rows l + 32 j of the tile.
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  static constexpr int kSlotsPerLane = kTileM / 32;
  static_assert(kTileM % 32 == 0 && kTileK % 64 == 0, "gathered rows: whole 4-row passes");

  struct Arguments : Base::Arguments {
    const void* w1 = nullptr;  // [E, K, 2I] bf16, gate then up columns
    int32_t ffn = 0;           // I: a multiple of tile_n / 2
    int32_t hidden = 0;        // K
    int32_t experts = 0;       // E: the groups that read w1
    // Groups at or past it load B as the base does, from their own pointers (the fused MoE
    // kernel's GEMM 2 groups, which follow its E GEMM 1 groups).
    int32_t plain_groups = INT32_MAX;
    GatheredRows gather;  // null row_slot: A as the base loads it
  };
  struct Params : Base::Params {
    TmaB tma_w1;
    // Gathered rows (null row_slot: none): x [x_rows, K], x_stride elements between rows.
    const int64_t* row_slot = nullptr;
    const int32_t* offs = nullptr;
    const ElementB* x = nullptr;
    int64_t x_stride = 0;
    int32_t x_rows = 0, rows = 0;
    int32_t ffn = 0, hidden = 0, experts = 0, plain_groups = INT32_MAX;
  };

  // Every caller's w1 arguments: experts E read w1 as stored, groups from plain_groups on load B
  // from their own pointers.
  static void set_w1(Arguments& args, const PlainW1& plain, int64_t experts,
                     int64_t plain_groups = INT32_MAX) {
    args.w1 = plain.w1;
    args.ffn = static_cast<int32_t>(plain.n / 2);
    args.hidden = static_cast<int32_t>(plain.k);
    args.experts = static_cast<int32_t>(experts);
    args.plain_groups = static_cast<int32_t>(plain_groups);
    args.gather = plain.gather;
  }

  // load_gathered's address of element (row, col) of a stage, in elements from the stage's
  // start: 64-column blocks of tile_m rows, rows 64 elements apart, each row's 16-byte chunks
  // permuted by the 128-byte swizzle (chunk c of row r at c ^ (r % 8)).
  static constexpr int64_t sw128_offset(int row, int col) {
    return static_cast<int64_t>(col / 64) * kTileM * 64 + row * 64 +
           (((col % 64) / 8) ^ (row % 8)) * 8 + col % 8;
  }
  // Whether the base's A stages are that layout (CuTe's K-major 128-byte swizzle atoms stacked
  // along M, then K), as the consumers address them (through a swizzled shared-memory pointer,
  // here a made-up one aligned as the kernel's; nothing is read): load_gathered computes its
  // addresses from sw128_offset.
  static bool stage_is_sw128() {
    using namespace cute;
    ElementB* base = reinterpret_cast<ElementB*>(uintptr_t{1} << 20);
    Tensor sA = make_tensor(make_smem_ptr(base), typename Base::SmemLayoutA{});
    for (int stage = 0; stage < static_cast<int>(size<2>(sA)); ++stage)
      for (int row = 0; row < kTileM; ++row)
        for (int col = 0; col < kTileK; col += 8)
          if (raw_pointer_cast(&sA(row, col, stage)) - base !=
              static_cast<int64_t>(stage) * kTileM * kTileK + sw128_offset(row, col))
            return false;
    return true;
  }

  // What load_gathered needs of the rows: 16-byte aligned rows of at least K elements, each
  // row's start a 32-bit count of 16-byte chunks from x.
  static bool gather_ok(const Arguments& args) {
    const GatheredRows& g = args.gather;
    static const bool layout_ok = stage_is_sw128();
    return layout_ok && g.x != nullptr && g.offs != nullptr &&
           reinterpret_cast<uintptr_t>(g.x) % 16 == 0 && g.x_rows >= 1 &&
           g.x_rows <= INT32_MAX && g.x_stride >= args.hidden && g.x_stride % 8 == 0 &&
           g.x_rows * (g.x_stride / 8) < UINT32_MAX && g.rows >= 0 && g.rows <= INT32_MAX &&
           args.plain_groups == INT32_MAX;
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, const Arguments& args,
                                        void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shapes, args, workspace);
    const auto* w1 = static_cast<const ElementB*>(args.w1);
    p.tma_w1 = make_tma(cute::make_tensor(w1, gmem_layout(args.ffn, args.hidden, args.experts)));
    p.ffn = args.ffn;
    p.hidden = args.hidden;
    p.experts = args.experts;
    p.plain_groups = args.plain_groups;
    if (args.gather.row_slot != nullptr && gather_ok(args)) {
      p.row_slot = args.gather.row_slot;
      p.offs = args.gather.offs;
      p.x = static_cast<const ElementB*>(args.gather.x);
      p.x_stride = args.gather.x_stride;
      p.x_rows = static_cast<int32_t>(args.gather.x_rows);
      p.rows = static_cast<int32_t>(args.gather.rows);
    }
    return p;
  }

  template <class ProblemShape>
  static bool can_implement(const ProblemShape& problem_shapes, const Arguments& args) {
    return args.w1 != nullptr && args.ffn > 0 && args.ffn % (kTileN / 2) == 0 &&
           args.hidden > 0 && args.experts > 0 &&
           (args.gather.row_slot == nullptr || gather_ok(args)) &&
           Base::can_implement(problem_shapes, args);
  }

  template <class TensorMapA, class TensorMapB, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(
      typename Base::TensorMapStorage& shared_tensormaps, const Params& params,
      const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps, ProblemShapeMNKL problem_mnkl,
      int32_t next_batch) {
    group_ = next_batch;
    if (params.row_slot != nullptr) {
      // The group's first GEMM row, clamped as the problem kernel clamps offs, and its rows.
      const int32_t begin = next_batch > 0 ? params.offs[next_batch - 1] : 0;
      row_begin_ = begin < 0 ? 0 : (begin > params.rows ? params.rows : begin);
      group_rows_ = cute::get<0>(problem_mnkl);
    }
    Base::tensormaps_perform_update(shared_tensormaps, params, input_tensormaps, problem_mnkl,
                                    next_batch);
  }

  // The base's load() with B from tma_w1: the same pipeline stages, barrier and transaction bytes
  // (the box is the base's B box), B multicast along M as the base's.
  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(const Params& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           const cute::tuple<TensorA, TensorB>& load_inputs,
                           const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps,
                           const BlockCoord& blk_coord, KTileIterator k_tile_iter,
                           int k_tile_count, int thread_idx, uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    if (group_ >= params.plain_groups) {
      Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord,
                 k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
      return;
    }
    if (params.row_slot != nullptr) {
      load_gathered(params, pipeline, smem_pipe_write, blk_coord, k_tile_iter, k_tile_count,
                    block_rank_in_cluster, shared_tensors);
      return;
    }
    if (!elect_one_sync()) return;
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    constexpr uint32_t cluster_m = size<0>(ClusterShapeMNK{});
    const uint32_t block_m = block_rank_in_cluster % cluster_m;
    const uint32_t block_n = block_rank_in_cluster / cluster_m;
    Tensor gA = get<0>(load_inputs)(_, _, get<0>(blk_coord), _, get<3>(blk_coord));
    auto block_tma_a = params.tma_load_a.get_slice(block_n);
    Tensor tAgA = block_tma_a.partition_S(gA);  // (BLK_M, BLK_K, k)
    Tensor tAsA = block_tma_a.partition_D(sA);
    auto b = b_copies(params, blk_coord, block_rank_in_cluster, shared_tensors);
    // A is shared along N within the cluster (the base's mask).
    uint16_t mask_a = 0;
    if constexpr (is_same_v<typename Base::GmemTiledCopyA, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<ClusterShapeMNK>{};  // (m, n) -> block id
      for (int n = 0; n < size<1>(block_layout); ++n)
        mask_a |= uint16_t(1) << block_layout(block_m, n, Int<0>{});
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      copy(params.tma_load_a.with(get<0>(input_tensormaps), *barrier, mask_a),
           tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, stage));
      copy(params.tma_w1.with(*barrier, get<2>(b)), get<0>(b)(_, _, _, *k_tile_iter),
           get<1>(b)(_, _, _, stage));
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

 private:
  // B's source and stage tiles from tma_w1 (the group is the expert) and its mask (multicast
  // along M, as the base's B): (tBgB (.., k), tBsB (.., PIPE), mask).
  template <class BlockCoord>
  CUTLASS_DEVICE auto b_copies(const Params& params, const BlockCoord& blk_coord,
                               uint32_t block_rank_in_cluster,
                               typename Base::TensorStorage& shared_tensors) const {
    using namespace cute;
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    constexpr uint32_t cluster_m = size<0>(ClusterShapeMNK{});
    const uint32_t block_m = block_rank_in_cluster % cluster_m;
    const uint32_t block_n = block_rank_in_cluster / cluster_m;
    Tensor mB = params.tma_w1.get_tma_tensor(
        make_shape(make_shape(_64{}, _2{}, params.ffn / 64), params.hidden, params.experts));
    Tensor gB_nkl = local_tile(mB, TileShape{}, make_coord(_, _, _), Step<Underscore, _1, _1>{});
    Tensor gB = gB_nkl(_, _, get<1>(blk_coord), _, group_);  // (BLK_N, BLK_K, k)
    auto block_tma_b = params.tma_w1.get_slice(block_m);
    auto block_layout = Layout<ClusterShapeMNK>{};  // (m, n) -> block id
    uint16_t mask_b = 0;
    if constexpr (is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      for (int m = 0; m < size<0>(block_layout); ++m)
        mask_b |= uint16_t(1) << block_layout(m, block_n, Int<0>{});
    }
    return make_tuple(block_tma_b.partition_S(gB), block_tma_b.partition_D(sB), mask_b);
  }

  // load() with A's rows gathered (the header's "Gathered rows"). Every lane of the producer
  // warp takes part; lane 0 is the pipeline's leader (it sets each stage's transaction bytes)
  // and also copies B. One warp issues every copy, so the per-copy work is kept to a shuffle,
  // an address and the copy: each lane holds its rows' starts in 16-byte chunks from x, and the
  // stage addresses are the lane's two swizzle patterns plus compile-time row offsets.
  template <class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_gathered(const Params& params, typename Base::MainloopPipeline pipeline,
                                    typename Base::PipelineState smem_pipe_write,
                                    const BlockCoord& blk_coord, KTileIterator k_tile_iter,
                                    int k_tile_count, uint32_t block_rank_in_cluster,
                                    typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    constexpr uint32_t kNone = 0xffffffffu;  // a row that reads zeros
    const int lane = static_cast<int>(threadIdx.x % 32);
    // Lane l's rows l + 32 j: where each starts, in 16-byte chunks from x, or kNone past the
    // expert's rows or for a slot outside x.
    const int m0 = static_cast<int>(get<0>(blk_coord)) * kTileM;
    const uint32_t chunks_per_row = static_cast<uint32_t>(params.x_stride / 8);
    uint32_t start[kSlotsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kSlotsPerLane; ++j) {
      const int r = m0 + lane + 32 * j;
      const int64_t g = static_cast<int64_t>(row_begin_) + r;
      start[j] = kNone;
      if (r < group_rows_ && g < params.rows) {
        const int64_t s = params.row_slot[g];
        if (s >= 0 && s < params.x_rows) start[j] = static_cast<uint32_t>(s) * chunks_per_row;
      }
    }
    auto b = b_copies(params, blk_coord, block_rank_in_cluster, shared_tensors);
    // Each pass copies rows 4 t + sub (t < tile_m / 4), 16-byte chunk `chunk` of 64 columns: 8
    // lanes per row. Row 4 t + sub's swizzle pattern depends on t's parity only.
    const int sub = lane / 8, chunk = lane % 8;
    const uint32_t smem_a = cast_smem_ptr_to_uint(shared_tensors.smem_A.data());
    uint32_t lane_dst[2];
    CUTLASS_PRAGMA_UNROLL
    for (int parity = 0; parity < 2; ++parity) {
      lane_dst[parity] = static_cast<uint32_t>(
          sizeof(ElementB) * sw128_offset(4 * parity + sub, 8 * chunk));
    }
    constexpr uint32_t kBytesA = kTileM * kTileK * sizeof(ElementB);
    const uint4* x = reinterpret_cast<const uint4*>(params.x);

    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);  // every lane waits; the leader expects A + B
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const int k_tile = static_cast<int>(*k_tile_iter);
      if (lane == 0) {
        copy(params.tma_w1.with(*barrier, get<2>(b)), get<0>(b)(_, _, _, k_tile),
             get<1>(b)(_, _, _, stage));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < kTileK / 64; ++kb) {
        const int col = k_tile * kTileK + 64 * kb + 8 * chunk;
        const uint32_t col_bytes = col < params.hidden ? 16u : 0u;  // columns past K: zeros
        const uint4* x_col = x + col / 8;
        const uint32_t dst_kb =
            smem_a + static_cast<uint32_t>(sizeof(ElementB) *
                                           (static_cast<int64_t>(stage) * kTileM * kTileK +
                                            static_cast<int64_t>(kb) * kTileM * 64));
        CUTLASS_PRAGMA_UNROLL
        for (int t = 0; t < kTileM / 4; ++t) {
          // Row 4 t + sub's start sits in lane (4 t + sub) % 32, register t / 8.
          const uint32_t row_start = __shfl_sync(0xffffffffu, start[t / 8], 4 * (t % 8) + sub);
          const bool ok = row_start != kNone;
          const uint4* src = x_col + (ok ? row_start : 0u);
          const uint32_t dst = dst_kb + lane_dst[t % 2] + (t / 2) * 8 * 64 * sizeof(ElementB);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                       "r"(ok ? col_bytes : 0u)
                       : "memory");
        }
      }
      // Holds the stage's phase open until this lane's copies have landed.
      cutlass::arch::cpasync_barrier_arrive(barrier);
      __syncwarp();
      // Every lane's hold is registered: A's bytes, which no tensor copy brings, are done.
      if (lane == 0) {
        cutlass::arch::ClusterTransactionBarrier::complete_transaction(
            barrier, block_rank_in_cluster, kBytesA);
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

  int32_t group_ = 0;
  int32_t row_begin_ = 0, group_rows_ = 0;  // gathered rows: the group's first GEMM row, rows
};

}  // namespace uniep::cuda::grouped
