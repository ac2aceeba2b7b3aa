// A throwaway sweep, kept so its results can be reproduced (one H100 at cbc0670 and one H200 at
// 97ac4c2, 2026-11-23; the JSON is in git history, added by 4f77f8d): CUTLASS 3 sm90 bf16 GEMMs
// (row-major A [m, k], B [k, n], D [m, n], fp32 accumulation) differing only in tile, cluster,
// kernel schedule and source operand, each exported as a C function that run.py times against
// torch.mm through ctypes. Not part of the package; build_run.sh builds it on the GPU machine.
#pragma once
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
template <class K>
using EpiFor =
    cute::conditional_t<cute::is_same_v<K, Coop>, cutlass::epilogue::TmaWarpSpecializedCooperative,
                        cutlass::epilogue::TmaWarpSpecialized>;

template <int TM, int TN, int CM, int CN, class KSched, class ElemC = cutlass::bfloat16_t>
struct V {
  using ESched = EpiFor<KSched>;
  using Bf16 = cutlass::bfloat16_t;
  using RowMajor = cutlass::layout::RowMajor;
  using TileShape = cute::Shape<cute::Int<TM>, cute::Int<TN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::Int<CM>, cute::Int<CN>, cute::_1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElemC, RowMajor, 8, Bf16,
      RowMajor, 8, ESched>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, 8, Bf16, RowMajor, 8,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KSched>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                      Epilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments args(const void* a, const void* b, void* d, int m, int n, int k,
                                       int sms, int swz) {
    typename Gemm::Arguments x{};
    x.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    x.problem_shape = {m, n, k, 1};
    x.mainloop.ptr_A = static_cast<const Bf16*>(a);
    x.mainloop.dA = typename Kernel::StrideA{int64_t(k), cute::_1{}, int64_t(m) * k};
    x.mainloop.ptr_B = static_cast<const Bf16*>(b);
    x.mainloop.dB = typename Kernel::StrideB{cute::_1{}, int64_t(n), int64_t(k) * n};
    x.epilogue.thread.alpha = 1.0f;
    x.epilogue.thread.beta = 0.0f;
    if constexpr (!cute::is_void_v<ElemC>) {
      x.epilogue.ptr_C = static_cast<const ElemC*>(d);
      x.epilogue.dC = typename Kernel::StrideC{int64_t(n), cute::_1{}, int64_t(m) * n};
    }
    x.epilogue.ptr_D = static_cast<Bf16*>(d);
    x.epilogue.dD = typename Kernel::StrideD{int64_t(n), cute::_1{}, int64_t(m) * n};
    x.hw_info.device_id = 0;
    x.hw_info.sm_count = sms;
    x.scheduler.max_swizzle_size = swz;
    return x;
  }
  static int run(const void* a, const void* b, void* d, int m, int n, int k, int sms, int swz,
                 void* ws, size_t wsb, cudaStream_t s) {
    auto x = args(a, b, d, m, n, k, sms, swz);
    if (Gemm::get_workspace_size(x) > wsb) return 2;
    Gemm g;
    if (g.can_implement(x) != cutlass::Status::kSuccess) return 3;
    if (g.initialize(x, ws, s) != cutlass::Status::kSuccess) return 4;
    if (g.run(s) != cutlass::Status::kSuccess) return 5;
    return 0;
  }
};

// NAME(a, b, d, m, n, k, sms, swizzle, workspace, workspace_bytes, stream) -> 0 or an error
// step; NAME_info() -> mainloop stages * 10^6 + shared memory KiB.
#define VARIANT(NAME, ...)                                                                 \
  extern "C" int NAME(const void* a, const void* b, void* d, int m, int n, int k, int sms, \
                      int swz, void* ws, size_t wsb, cudaStream_t s) {                     \
    return V<__VA_ARGS__>::run(a, b, d, m, n, k, sms, swz, ws, wsb, s);                    \
  }                                                                                        \
  extern "C" int NAME##_info() {                                                           \
    using T = V<__VA_ARGS__>;                                                              \
    return T::Mainloop::DispatchPolicy::Stages * 1000000 +                                 \
           int(sizeof(typename T::Kernel::SharedStorage) / 1024);                          \
  }
