// A sweep of the expert GEMM's configurations on the expert loads of bench_experts and
// bench_decode (prefill: about 256 and 128 rows an expert; decode: a few rows each), kept so its
// results can be reproduced: CUTLASS 3 sm90 ptr-array ("grouped") bf16 GEMMs, x[rows of e] w[e]
// -> d[rows of e] with x and d row-major and w[e] row-major [K, N], fp32 accumulation, no C, the
// shapes and pointers in device arrays as the engine keeps them (cpp/cuda/gemm/grouped/). They
// differ in tile, cluster and schedule, and the Swap ones compute d^T = w^T x^T (the weights'
// columns as M, the tokens as N: no 64-row MMA padding of a decode step's few rows); run.py also
// sweeps the scheduler's raster order and swizzle. None of that should change an output bit (no
// split-K: each element is one fp32 sum over K in ascending WGMMA k-steps), so run.py requires
// the engine's own bits from every point. Each variant is a C function that run.py times through
// ctypes. Not part of the package; build_run.sh builds it on the GPU machine.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

namespace gv {

using Bf16 = cutlass::bfloat16_t;
using RowMajorArray = cutlass::layout::RowMajor*;  // one pointer and one stride per group
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape = ProblemShape::UnderlyingProblemShape;
using StrideA = cute::Stride<int64_t, cute::_1, cute::_0>;  // x [M, K]
using StrideB = cute::Stride<cute::_1, int64_t, cute::_0>;  // w [K, N], as CUTLASS's (N, K)
using StrideD = cute::Stride<int64_t, cute::_1, cute::_0>;  // d [M, N]
// The same product with the operands' roles swapped, d^T = w^T x^T (decode: the weights' columns
// are the M side and the tokens the N side, so a tile's MMA is not padded to 64 token rows):
using SwapStrideA = cute::Stride<cute::_1, int64_t, cute::_0>;  // w [K, N] as (N, K), N-contiguous
using SwapStrideB = cute::Stride<int64_t, cute::_1, cute::_0>;  // x [M, K] as (M, K)
using SwapStrideD = cute::Stride<cute::_1, int64_t, cute::_0>;  // d [M, N] as (N, M)
static_assert(sizeof(StrideA) == 8 && sizeof(SwapStrideA) == 8 && sizeof(SwapStrideD) == 8);

// The device arrays of one grouped product (problems.cu fills them); a stride is 8 bytes
// whichever its type.
struct Problems {
  int groups = 0;
  Shape* shapes = nullptr;
  const Bf16** a = nullptr;
  const Bf16** b = nullptr;
  Bf16** d = nullptr;
  void* sa = nullptr;
  void* sb = nullptr;
  void* sd = nullptr;
};

// Swap: the variant takes the swapped product (problems.cu's gv_prepare_swapped).
template <int TM, int TN, int TK, int CM, int CN, bool PingPong, bool Swap = false>
struct V {
  using LayoutA = cute::conditional_t<Swap, cutlass::layout::ColumnMajor*, RowMajorArray>;
  using LayoutB = cute::conditional_t<Swap, cutlass::layout::ColumnMajor*, RowMajorArray>;
  using LayoutD = cute::conditional_t<Swap, cutlass::layout::ColumnMajor*, RowMajorArray>;
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::Int<TK>>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using MainloopSchedule =
      cute::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule =
      cute::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, 8, Bf16,
      LayoutD, 8, EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA, 8, Bf16, LayoutB, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  // The per-group stride types, as the arguments hold them (pointers to one per group).
  using SA = std::remove_pointer_t<decltype(typename Gemm::Arguments{}.mainloop.dA)>;
  using SB = std::remove_pointer_t<decltype(typename Gemm::Arguments{}.mainloop.dB)>;
  using SD = std::remove_pointer_t<decltype(typename Gemm::Arguments{}.epilogue.dD)>;
  static_assert(cute::is_same_v<SA, cute::conditional_t<Swap, SwapStrideA, StrideA>> &&
                cute::is_same_v<SB, cute::conditional_t<Swap, SwapStrideB, StrideB>> &&
                cute::is_same_v<SD, cute::conditional_t<Swap, SwapStrideD, StrideD>>);
  using RasterOrder = typename Kernel::TileScheduler::RasterOrderOptions;

  // raster: 0 along M (the engine's), 1 along N; swz: the scheduler's largest swizzle.
  static int run(const Problems& p, int sms, int raster, int swz, void* ws, size_t wsb,
                 cudaStream_t s) {
    typename Gemm::Arguments x{};
    x.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    x.problem_shape.num_groups = p.groups;
    x.problem_shape.problem_shapes = p.shapes;
    x.problem_shape.host_problem_shapes = nullptr;  // as the engine: shapes only on the device
    x.mainloop.ptr_A = p.a;
    x.mainloop.dA = static_cast<SA*>(p.sa);
    x.mainloop.ptr_B = p.b;
    x.mainloop.dB = static_cast<SB*>(p.sb);
    x.epilogue.thread.alpha = 1.0f;
    x.epilogue.thread.beta = 0.0f;
    x.epilogue.ptr_C = nullptr;
    x.epilogue.dC = nullptr;
    x.epilogue.ptr_D = p.d;
    x.epilogue.dD = static_cast<SD*>(p.sd);
    int device = 0;
    cudaGetDevice(&device);
    x.hw_info.device_id = device;
    x.hw_info.sm_count = sms;
    x.scheduler.raster_order = raster == 1 ? RasterOrder::AlongN : RasterOrder::AlongM;
    x.scheduler.max_swizzle_size = swz;
    if (Gemm::get_workspace_size(x) > wsb) return 2;
    Gemm g;
    if (g.can_implement(x) != cutlass::Status::kSuccess) return 3;
    if (g.initialize(x, ws, s) != cutlass::Status::kSuccess) return 4;
    if (g.run(s) != cutlass::Status::kSuccess) return 5;
    return cudaGetLastError() == cudaSuccess ? 0 : 6;
  }
};

}  // namespace gv

// NAME(problems, sms, raster, swizzle, workspace, workspace_bytes, stream) -> 0 or an error step;
// NAME_info() -> mainloop stages * 10^6 + shared memory KiB.
#define VARIANT(NAME, ...)                                                                       \
  extern "C" int NAME(const gv::Problems* p, int sms, int raster, int swz, void* ws, size_t wsb, \
                      cudaStream_t s) {                                                          \
    return gv::V<__VA_ARGS__>::run(*p, sms, raster, swz, ws, wsb, s);                            \
  }                                                                                              \
  extern "C" int NAME##_info() {                                                                 \
    using T = gv::V<__VA_ARGS__>;                                                                \
    return T::Mainloop::DispatchPolicy::Stages * 1000000 +                                       \
           int(sizeof(typename T::Kernel::SharedStorage) / 1024);                                \
  }
