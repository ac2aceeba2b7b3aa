// The first expert GEMM's mainloop reading its A rows in place (GroupedGemmProblem::row_slot):
// row r of the product is row row_slot[r] of a source (a dispatch's receive slots, or the
// tokens themselves at world 1), so no gathered copy of the rows is made and read back.
//
// Why: before the GEMM, a gather wrote every (token, k) row in expert order (k times the tokens'
// bytes: 134 MB on a Qwen3-like layer of 4096 tokens, about 7% of its forward on one H200) for
// the GEMM to read once. Read in place, the tokens are k times fewer bytes and mostly in L2.
//
// How: Hopper's TMA has no row gather. One-row TMA boxes do land in the stage's swizzled image
// (each box is swizzled by its destination address), but 64 of them a k-block made the GEMM
// 4.4-5.4x slower on one H200 (2026-12-04): the producer issued them one by one. So the
// producer warp copies A with cp.async, 16 bytes a lane, four rows of 128 bytes per warp
// instruction, each piece stored where the 128-byte swizzle puts it (its 16-byte column XOR the
// row's position in the 1 KB atom, as the TMA's swizzle does by address). B stays the base's
// TMA. A stage's barrier then expects B's bytes only and takes its one arrival from lane 0 once
// the warp's copies of that stage have landed (cp.async groups, kDepth stages in flight) and
// been fenced for the tensor cores' proxy. A tile's rows past its expert's count copy the tile's
// first row (their output rows are never stored); a slot outside the source copies zeros. The
// consumers, the epilogue and the scheduler are the base's, so the bits are those of the GEMM
// on the gathered rows.
//
// Only tiles 64 deep in K (one 128-byte swizzle row per k-block) in no cluster along N (whose
// CTAs would share A by multicast); the dispatcher refuses the others.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include <cstdint>

#include "cuda/gemm/grouped/group_mainloop.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::grouped {

template <class Base>
struct SlotRowsMainloop : GroupTrackingMainloop<Base> {
  using Tracking = GroupTrackingMainloop<Base>;
  using TileShape = typename Base::TileShape;
  using ClusterShapeMNK = typename Base::DispatchPolicy::ClusterShape;
  static constexpr int kTileM = cute::size<0>(TileShape{});
  static constexpr int kTileK = cute::size<2>(TileShape{});
  // One swizzled 128-byte row per box, and A loaded per CTA (a cluster along N would multicast
  // it): the other configurations load as the base does and are refused rows in place.
  static constexpr bool kTakesSlots = kTileK == 64 && cute::size<1>(ClusterShapeMNK{}) == 1;

  struct Arguments : Base::Arguments {
    SlotRows slots;  // slots.row_slot null: A is the rows themselves (the base's load)
  };
  struct Params : Base::Params {
    SlotRows slots;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, const Arguments& args,
                                        void* workspace) {
    Params p = Tracking::template base_params<Params>(problem_shapes, args, workspace);
    p.slots = args.slots;
    return p;
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(const Params& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           const cute::tuple<TensorA, TensorB>& load_inputs,
                           const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps,
                           const BlockCoord& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    if constexpr (!kTakesSlots) {
      Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord,
                 k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
    } else {
      if (params.slots.row_slot == nullptr) {
        Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord,
                   k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
        return;
      }
      load_slots(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord,
                 k_tile_iter, k_tile_count, block_rank_in_cluster, shared_tensors);
    }
  }

 private:
  static constexpr int kRowsPerLane = kTileM / 32;
  static_assert(kTileM % 32 == 0, "the producer warp's lanes split the tile's rows evenly");
  // Stages whose A copies may be in flight before the oldest is waited for and signalled.
  static constexpr int kDepth = 2;
  static_assert(Base::DispatchPolicy::Stages > kDepth, "the copies in flight need free stages");

  // The oldest stage in flight: its copies landed (this lane's), fenced for the tensor cores'
  // async proxy, then the warp's one arrival.
  template <int Pending>
  CUTLASS_DEVICE static void retire(uint32_t barrier, int lane) {
    asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(barrier) : "memory");
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load_slots(const Params& params, typename Base::MainloopPipeline pipeline,
                                 typename Base::PipelineState smem_pipe_write,
                                 const cute::tuple<TensorA, TensorB>& load_inputs,
                                 const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps,
                                 const BlockCoord& blk_coord, KTileIterator k_tile_iter,
                                 int k_tile_count, uint32_t block_rank_in_cluster,
                                 typename Base::TensorStorage& shared_tensors) {
    using namespace cute;
    const int lane = static_cast<int>(threadIdx.x % 32);
    // The stage's rows are 128 bytes apart, stages TileM rows apart: the unswizzled layout the
    // swizzled one composes.
    constexpr auto kPlainA = typename Base::SmemLayoutA{}.layout_b();
    static_assert(kPlainA(1, 0, 0) == kTileK && kPlainA(0, 0, 1) == kTileM * kTileK,
                  "A's stages hold their rows 128 bytes apart, one stage after another");
    constexpr uint32_t kStageBytes = kTileM * kTileK * 2;
    constexpr uint32_t kBytesB = size<1>(TileShape{}) * kTileK * 2;  // B's box of a stage
    const uint32_t stage0 = cast_smem_ptr_to_uint(shared_tensors.smem_A.data());

    // This tile's rows: the group's first row (from its A pointer, which the problem kernel set
    // to x + first row x k), then the tile's; the rows past the expert's copy the tile's first.
    // Lane l holds the slots of rows l + 32 i (-1: outside the source).
    const auto m_coord = static_cast<int>(get<0>(blk_coord));
    const int64_t group_first =
        (reinterpret_cast<const Bf16*>(params.ptr_A[this->group_]) - params.slots.x) /
        params.slots.k;
    const int tile_first = m_coord * kTileM;
    const int64_t first = group_first + tile_first;
    int32_t slot[kRowsPerLane];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRowsPerLane; ++i) {
      const int row = lane + 32 * i;
      const int64_t r = tile_first + row < this->group_rows_ ? first + row : first;
      const int64_t v = params.slots.row_slot[r];
      slot[i] = v >= 0 && v < params.slots.slots ? static_cast<int32_t>(v) : -1;
    }

    // B as the base loads it (multicast along M within the cluster).
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    constexpr uint32_t cluster_m = size<0>(ClusterShapeMNK{});
    const uint32_t block_m = block_rank_in_cluster % cluster_m;
    Tensor gB = get<1>(load_inputs)(_, _, get<1>(blk_coord), _, get<3>(blk_coord));
    auto block_tma_b = params.tma_load_b.get_slice(block_m);
    Tensor tBgB = block_tma_b.partition_S(gB);
    Tensor tBsB = block_tma_b.partition_D(sB);
    uint16_t mask_b = 0;
    if constexpr (is_same_v<typename Base::GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>) {
      auto block_layout = Layout<ClusterShapeMNK>{};  // (m, n) -> block id
      for (int m = 0; m < size<0>(block_layout); ++m)
        mask_b |= uint16_t(1) << block_layout(m, 0, Int<0>{});
    }

    // Warp instruction j copies rows 4j .. 4j + 3: lane l the 16-byte column l % 8 of row
    // 4j + l / 8, so each instruction reads four whole 128-byte rows.
    const int column = lane % 8;
    const char* src = reinterpret_cast<const char*>(params.slots.x) + column * 16;
    const int64_t pitch = params.slots.stride_bytes;
    uint32_t pending0 = 0, pending1 = 0;  // the barriers of the stages in flight, oldest first
    int in_flight = 0;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      // The stage free (every lane waits; none arrives: the arrival comes with A's rows).
      while (pipeline.producer_try_acquire(smem_pipe_write).get() !=
             cutlass::BarrierStatus::WaitDone) {
      }
      auto* barrier = pipeline.producer_get_barrier(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      if (lane == 0) {
        cutlass::arch::ClusterTransactionBarrier::expect_transaction(barrier, kBytesB);
        copy(params.tma_load_b.with(get<1>(input_tensormaps), *barrier, mask_b),
             tBgB(_, _, _, *k_tile_iter), tBsB(_, _, _, stage));
      }
      const int64_t k_bytes = static_cast<int64_t>(*k_tile_iter) * kTileK * 2;
      const uint32_t rows = stage0 + stage * kStageBytes;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRowsPerLane; ++i) {
        // Rows 32 i .. 32 i + 31, whose slots lane l holds for row 32 i + l.
#pragma unroll 2
        for (int j = 0; j < 8; ++j) {
          const int in_block = 4 * j + lane / 8;
          const int32_t s = __shfl_sync(0xffffffffu, slot[i], in_block);
          const uint32_t line = rows + (32 * i + in_block) * 128;
          const uint32_t dst = line + ((column ^ ((line >> 7) & 7)) << 4);
          const char* from = s >= 0 ? src + s * pitch + k_bytes : src;
          const uint32_t bytes = s >= 0 ? 16 : 0;  // 0: the piece is zero-filled
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(from),
                       "r"(bytes)
                       : "memory");
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
      const uint32_t mine = cast_smem_ptr_to_uint(barrier);
      if (in_flight == kDepth) {
        retire<kDepth>(pending0, lane);
        pending0 = pending1;
        pending1 = mine;
      } else if (in_flight == 1) {
        pending1 = mine;
        in_flight = 2;
      } else {
        pending0 = mine;
        in_flight = 1;
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
    // The tile's last stages: all copies landed, each stage signalled in order.
    if (in_flight >= 1) retire<0>(pending0, lane);
    if (in_flight == 2) retire<0>(pending1, lane);
  }
};

}  // namespace uniep::cuda::grouped
