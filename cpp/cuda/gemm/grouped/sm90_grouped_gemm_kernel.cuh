// The CUTLASS 3 configuration of the grouped GEMM (include/uniep/cuda/grouped_gemm.hpp): the
// ptr-array ("grouped") flavour of the TMA warp-specialized cooperative kernel, persistent, one
// group per expert, 128 x 128 x 64 tiles on clusters of two CTAs along N.
//
// Why these choices:
//  - Clusters along N, not M: an expert's row count is anything from 0 up, and the scheduler
//    rounds each group's M tiles up to the cluster's M extent, so a cluster along M would leave
//    half its CTAs idle on the 128-row experts of a many-expert layer. Along N (4096, 7168: even
//    tile counts) the two CTAs share one A tile through TMA multicast instead.
//  - No C operand (ElementC = void): D = acc, so the epilogue never loads anything, and D's bits
//    are the fp32 accumulator rounded once to bf16.
//  - The group tile scheduler walks the groups in order and gives a group with M = 0 no tiles, so
//    an empty expert costs a few scheduler instructions and no memory traffic. It never splits K.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace uniep::cuda {

struct Sm90Bf16GroupedGemm {
  using Bf16 = cutlass::bfloat16_t;
  // Pointer layout tags select the grouped kernels: one pointer and one stride per group.
  using RowMajorArray = cutlass::layout::RowMajor*;
  static constexpr int kAlign = 16 / sizeof(Bf16);  // TMA moves 16-byte aligned rows
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  // (M, N, K) of one group; filled on the device (grouped_problems.cuh).
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajorArray, kAlign,
      Bf16, RowMajorArray, kAlign,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajorArray, kAlign, Bf16,
      RowMajorArray, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // Row-major x (M x K) is K-major; row-major w[e] (K x N) is N-major; row-major out is N-major.
  // One stride per group, the same for all of them (the problem kernel writes E copies).
  static_assert(cute::is_same_v<StrideA, cute::Stride<int64_t, cute::_1, cute::_0>>);
  static_assert(cute::is_same_v<StrideB, cute::Stride<cute::_1, int64_t, cute::_0>>);
  static_assert(cute::is_same_v<StrideD, cute::Stride<int64_t, cute::_1, cute::_0>>);
};

}  // namespace uniep::cuda
