// The CUTLASS 3 configurations of the grouped GEMM (include/uniep/cuda/grouped_gemm.hpp): the
// ptr-array ("grouped") flavour of the TMA warp-specialized persistent kernels, one group per
// expert, in a fixed set of instantiations (grouped_configs.hpp lists them; one .cu each, so they
// compile in parallel).
//
// What every configuration shares, and why:
//  - No C operand (ElementC = void): D = acc, so the epilogue never loads anything, and D's bits
//    are the fp32 accumulator rounded once to bf16.
//  - The group tile scheduler walks the groups in order and gives a group with M = 0 no tiles, so
//    an empty expert costs a few scheduler instructions and no memory traffic. It never splits K:
//    every output element is one fp32 sum over K in ascending order of WGMMA k-steps (16 wide
//    for bf16) whatever the tile, cluster or schedule, so the bits do not depend on the
//    configuration (tests/gemm/test_gpu_grouped_gemm.py checks it across all of them).
//  - Cooperative kernels split one tile's rows between two consumer warpgroups (tile_m 128 or
//    256); ping-pong kernels give each of two warpgroups its own tile (tile_m 64), so one's
//    epilogue overlaps the other's mainloop: the better choice when experts have few rows.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/gemm/grouped/gate_up_mainloop.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/signal_store_epilogue.cuh"
#include "cuda/gemm/grouped/swiglu_epilogue.cuh"

namespace uniep::cuda::grouped {

// What the epilogue does with the fp32 accumulators: store them (rounded to bf16) through TMA,
// store them as they are (kStoreF32: fp32 D, through TMA too), or apply SwiGLU to (gate, up) column
// pairs and store the activation (swiglu_epilogue.cuh), with w1 packed by pack_gate_up (kSwiGlu) or
// as stored, gate columns then up (kSwiGluPlain: B read through PlainGateUpMainloop,
// gate_up_mainloop.cuh), or store them directly and signal each finished row block (kStoreSignal:
// signal_store_epilogue.cuh; the gated GEMM only).
enum class GroupedEpilogue { kStore, kSwiGlu, kSwiGluPlain, kStoreSignal, kStoreF32 };

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, bool PingPong,
          GroupedEpilogue Epi, GroupedKind Kind = GroupedKind::kForward>
struct Sm90GroupedGemm {
  static_assert(Epi == GroupedEpilogue::kStore || Kind == GroupedKind::kForward,
                "the SwiGLU and fp32 epilogues belong to the forward's GEMMs");
  static constexpr bool kPlain = Epi == GroupedEpilogue::kSwiGluPlain;
  // Stored through TMA (kStore in bf16, kStoreF32 in fp32) rather than by a direct epilogue.
  static constexpr bool kTmaStore =
      Epi == GroupedEpilogue::kStore || Epi == GroupedEpilogue::kStoreF32;
  using ElementD = cute::conditional_t<Epi == GroupedEpilogue::kStoreF32, float, Bf16>;
  using LayoutA = typename KindLayouts<Kind>::LayoutA;
  using LayoutB = typename KindLayouts<Kind>::LayoutB;
  using StrideA = typename KindLayouts<Kind>::StrideA;
  using StrideB = typename KindLayouts<Kind>::StrideB;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<TileK>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using MainloopSchedule =
      cute::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      cute::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

  using StoreEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajorArray, kAlign,
      ElementD, RowMajorArray, static_cast<int>(16 / sizeof(ElementD)),
      EpilogueSchedule>::CollectiveOp;
  using DirectEpilogue = cute::conditional_t<Epi == GroupedEpilogue::kStoreSignal,
                                             SignalStoreEpilogue, SwiGluEpilogue<kPlain ? 64 : 8>>;
  using Epilogue = cute::conditional_t<
      kTmaStore, StoreEpilogue,
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<DirectEpilogue>>;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA, kAlign, Bf16, LayoutB,
      kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Mainloop = cute::conditional_t<kPlain, PlainGateUpMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
  static constexpr GroupedEpilogue kEpilogue = Epi;
  static constexpr GroupedKind kKind = Kind;

  // The problem kernel (grouped_problems.cuh) writes one stride of each of these per group.
  static_assert(cute::is_same_v<typename Kernel::InternalStrideA, StrideA>);
  static_assert(cute::is_same_v<typename Kernel::InternalStrideB, StrideB>);
  static_assert(cute::is_same_v<typename Kernel::InternalStrideD, StrideD>);
  static_assert(cute::is_same_v<typename ProblemShape::UnderlyingProblemShape, Shape>);
};

}  // namespace uniep::cuda::grouped
