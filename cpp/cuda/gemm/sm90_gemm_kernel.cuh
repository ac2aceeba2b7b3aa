// One CUTLASS 3 configuration of gemm.hpp's kernel: 128 x TileN x 64 tiles on clusters of two
// along M, cooperative (two consumer warpgroups per tile), persistent. The same kernel serves
// D = A @ B and D = A @ B + C: with beta = 0 the epilogue never loads C. Each TileN is
// instantiated in its own translation unit (sm90_bf16_gemm_n*.cu), so they compile in parallel.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/gemm/cutlass_launch.cuh"
#include "cuda/gemm/gemm.hpp"

namespace uniep::cuda {

template <int TileN>
struct Sm90Bf16Gemm {
  using Bf16 = cutlass::bfloat16_t;
  using RowMajor = cutlass::layout::RowMajor;
  static constexpr int kAlign = 16 / sizeof(Bf16);  // TMA moves 16-byte aligned rows
  using TileShape = cute::Shape<cute::_128, cute::Int<TileN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Bf16, RowMajor, kAlign, Bf16,
      RowMajor, kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlign, Bf16, RowMajor,
      kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideRow = cute::Stride<int64_t, cute::_1, int64_t>;

  // Row-major A is K-major, row-major B (k x n) is N-major, row-major C/D are N-major: the
  // stride types the builder chose for those layouts.
  static_assert(cute::is_same_v<typename Kernel::StrideA, StrideRow>);
  static_assert(
      cute::is_same_v<typename Kernel::StrideB, cute::Stride<cute::_1, int64_t, int64_t>>);
  static_assert(cute::is_same_v<typename Kernel::StrideC, StrideRow>);
  static_assert(cute::is_same_v<typename Kernel::StrideD, StrideRow>);

  static typename Gemm::Arguments arguments(const GemmOperands& op, const GemmTuning& tuning,
                                            int device, int sm_count) {
    using Raster =
        typename cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {static_cast<int>(op.m), static_cast<int>(op.n), static_cast<int>(op.k),
                          1};
    args.mainloop.ptr_A = static_cast<const Bf16*>(op.a);
    args.mainloop.dA = StrideRow{op.lda, cute::_1{}, op.m * op.lda};
    args.mainloop.ptr_B = static_cast<const Bf16*>(op.b);
    args.mainloop.dB = typename Kernel::StrideB{cute::_1{}, op.ldb, op.k * op.ldb};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = op.c != nullptr ? 1.0f : 0.0f;
    // Without an addend C is never read (beta = 0), but its TMA descriptor is still built: D's
    // address and layout are a valid placeholder.
    const int64_t ldc = op.c != nullptr ? op.ldc : op.ldd;
    args.epilogue.ptr_C = static_cast<const Bf16*>(op.c != nullptr ? op.c : op.d);
    args.epilogue.dC = StrideRow{ldc, cute::_1{}, op.m * ldc};
    args.epilogue.ptr_D = static_cast<Bf16*>(op.d);
    args.epilogue.dD = StrideRow{op.ldd, cute::_1{}, op.m * op.ldd};
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
    args.scheduler.max_swizzle_size = tuning.swizzle > 0 ? tuning.swizzle : 1;
    args.scheduler.raster_order = tuning.raster == GemmRaster::kAlongM   ? Raster::AlongM
                                  : tuning.raster == GemmRaster::kAlongN ? Raster::AlongN
                                                                         : Raster::Heuristic;
    return args;
  }

  static size_t workspace_bytes(const GemmOperands& op, const GemmTuning& tuning, int sm_count) {
    return Gemm::get_workspace_size(arguments(op, tuning, 0, sm_count));
  }

  static Status run(const GemmOperands& op, const GemmTuning& tuning, int device, int sm_count,
                    void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    const typename Gemm::Arguments args = arguments(op, tuning, device, sm_count);
    const size_t need = Gemm::get_workspace_size(args);
    if (need > workspace_bytes)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("the sm90 GEMM needs ", need, " bytes of workspace, got ",
                              workspace_bytes)};
    return launch_cutlass<Gemm>(args, workspace, stream, "the sm90 GEMM");
  }
};

}  // namespace uniep::cuda
