// The fp8 grouped GEMM's CUTLASS kernels (include/uniep/cuda/grouped_gemm.hpp,
// grouped_gemm_fp8), one instantiation per compiled tile in its own sm90_grouped_fp8_<name>.cu,
// and what the dispatcher (sm90_grouped_fp8.cu) needs of them.
//
// CUTLASS's blockwise-scaled ptr-array kernels apply the scales on the fp32 side: each 128-deep
// k-block's WGMMA partial sum is multiplied by its A and B scales and added into the fp32
// accumulator (promoted every k-block, so fp8's 2^-4 relative step never compounds over K). Our
// mainloop (fp8_pipelined_mainloop.cuh) keeps two partial sums live beside the accumulator, so
// that one k-block's promotion runs under the next one's WGMMAs, and a warpgroup's tile stays at
// 64 x 128: 192 accumulator registers a thread (64 x 256 would need 384). Every tile walks k in
// the same 128-deep blocks in the same order, so the bits do not depend on the configuration.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include <cutlass/cutlass.h>
#include <cutlass/float8.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/gemm/cutlass_launch.cuh"
#include "cuda/gemm/grouped/fp8_pipelined_mainloop.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "cuda/gemm/grouped/swiglu_epilogue.cuh"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda::grouped_fp8 {

using grouped::Bf16;
using Fp8 = cutlass::float_e4m3_t;
constexpr int kBlock = 128;                  // scale block (k, and n for the weights)
constexpr int kFp8Align = 16 / sizeof(Fp8);  // TMA moves 16-byte rows
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
// The first GEMM with SwiGLU in its epilogue reads w1 packed in blocks of 64 columns (gate, up;
// grouped_gemm_fp8's GroupedGemmFp8Problem::swiglu) with one weight scale per 64 columns: each
// the scale of the 128 x 128 block the 64 columns came from, so the products are the unpacked
// weight's.
constexpr int kHalfBlock = kBlock / 2;
using ScaleConfig64 = cutlass::detail::Sm90BlockwiseScaleConfig<1, kHalfBlock, kBlock>;
using LayoutSFB64 = decltype(ScaleConfig64::deduce_layoutSFB());
static_assert(sizeof(LayoutSFB64) == sizeof(LayoutSFB),
              "one array of per-group B-scale layouts serves both kinds");
// The product with the operands' roles swapped (SwapGemm): the weights' 128 x 128 blocks are
// the A scales, the rows' 1 x 128 blocks the B scales. Both are MN-major, so they read the same
// memory as the unswapped layouts: w_scales [E, k / 128, n / 128] and the rows' reordered
// [k / 128][rows of e]; only the layouts' static block sizes differ.
using SwapScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<kBlock, 1, kBlock>;
using SwapLayoutSFA = decltype(SwapScaleConfig::deduce_layoutSFA());
using SwapLayoutSFB = decltype(SwapScaleConfig::deduce_layoutSFB());
static_assert(sizeof(SwapLayoutSFA) == sizeof(LayoutSFA) &&
                  sizeof(SwapLayoutSFB) == sizeof(LayoutSFB),
              "the per-group scale layouts' arrays serve both roles");
// The swapped product's out: out^T (M the output columns, N the rows) over out's row-major
// memory, one dynamic stride in grouped::StrideD's slot (set_store_epilogue).
using SwapStrideD = cute::Stride<cute::_1, int64_t, cute::_0>;
static_assert(sizeof(SwapStrideD) == sizeof(grouped::StrideD));

// The fp8 call's own arrays, after the bf16 kinds' (grouped_workspace.hpp): per group the scale
// pointers and layouts, then the rows' scales reordered M-major per expert.
struct Arrays {
  const float** ptr_sfa = nullptr;
  const float** ptr_sfb = nullptr;
  LayoutSFA* layout_sfa = nullptr;
  LayoutSFB* layout_sfb = nullptr;  // read as LayoutSFB64 by the SwiGLU kernel (layout_sfb64)
                                    // and both as Swap* by the swapped kernel
  float* sfa = nullptr;             // [rows * k / 128]
  void* gemm = nullptr;

  CUTLASS_HOST_DEVICE LayoutSFB64* layout_sfb64() const {
    return reinterpret_cast<LayoutSFB64*>(layout_sfb);
  }
  CUTLASS_HOST_DEVICE SwapLayoutSFA* swap_layout_sfa() const {
    return reinterpret_cast<SwapLayoutSFA*>(layout_sfa);
  }
  CUTLASS_HOST_DEVICE SwapLayoutSFB* swap_layout_sfb() const {
    return reinterpret_cast<SwapLayoutSFB*>(layout_sfb);
  }
};

// The CUTLASS kernel of one fp8 configuration around its epilogue: the blockwise-scaled ptr-array
// collective with A row-major and B column-major (both K-major, as fp8 WGMMA reads them), its
// stages sized around the epilogue's shared memory, and our mainloop (CUTLASS's with the
// promotion taken off the WGMMAs' path).
template <class TileShape, class ClusterShape, class KernelSchedule, class Epilogue, class SFA,
          class SFB>
struct Fp8Kernel {
  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8,
      cute::tuple<cutlass::layout::RowMajor*, SFA*>, kFp8Align, Fp8,
      cute::tuple<cutlass::layout::ColumnMajor*, SFB*>, kFp8Align, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Mainloop = PipelinedScaleMainloop<BuiltMainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<grouped::ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  static_assert(cute::is_same_v<StrideA, grouped::KMajorA>);
  static_assert(cute::is_same_v<StrideB, grouped::KMajorB>);
  static constexpr int kStages = Mainloop::DispatchPolicy::Stages;
};

// CUTLASS's TMA store epilogue of D (no C) in layout LayoutD: bf16, or fp32 (the accumulator as
// is, for combine=rank_partials).
template <class TileShape, class ClusterShape, class EpilogueSchedule, class LayoutD,
          class Out = Bf16>
using StoreEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD, grouped::kAlign,
    Out, LayoutD, static_cast<int>(16 / sizeof(Out)), EpilogueSchedule>::CollectiveOp;

template <bool PingPong>
using EpilogueScheduleOf =
    cute::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
template <bool PingPong>
using KernelScheduleOf =
    cute::conditional_t<PingPong,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>;

template <int TileM>
using GemmTile = cute::Shape<cute::Int<TileM>, cute::_128, cute::_128>;
template <int ClusterM, int ClusterN>
using GemmCluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
template <int TileM, int ClusterM, int ClusterN, bool PingPong, bool SwiGlu, class Out>
using GemmEpilogue = cute::conditional_t<
    SwiGlu,
    cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<
        grouped::SwiGluEpilogue<64>>,
    StoreEpilogue<GemmTile<TileM>, GemmCluster<ClusterM, ClusterN>, EpilogueScheduleOf<PingPong>,
                  cutlass::layout::RowMajor*, Out>>;

// SwiGlu: the SwiGLU epilogue on w1 packed in blocks of 64 (SwiGluEpilogue<64>), its scales per
// 64 columns; otherwise D = the product, stored through TMA in Out (bf16 or fp32).
template <int TileM, int ClusterM, int ClusterN, bool PingPong, bool SwiGlu = false,
          class Out = Bf16>
struct Gemm
    : Fp8Kernel<GemmTile<TileM>, GemmCluster<ClusterM, ClusterN>, KernelScheduleOf<PingPong>,
                GemmEpilogue<TileM, ClusterM, ClusterN, PingPong, SwiGlu, Out>, LayoutSFA,
                cute::conditional_t<SwiGlu, LayoutSFB64, LayoutSFB>> {
  static constexpr bool kSwiGlu = SwiGlu;
  static constexpr bool kSwapped = false;
};

// The product with the operands' roles swapped, out^T = w[e] x^T: the weights' output columns
// are the tile's M (128 of them), the rows its N (TileRows). Why: in decode an expert holds a
// few rows, and the unswapped tile pads them to WGMMA's 64-row M, 4-64 times the tensor-core
// work and the promotion's per-element work of the rows present, where N comes in steps of 8.
// Both operands stay K-major (as fp8 WGMMA needs): w[e] [n, k] is A row-major, the rows [m, k]
// are B column-major, and out^T is stored column-major into out's rows. Each output element is
// the same 128-deep WGMMA partial sums from zero, promoted k-block by k-block as
// accum += partial * (its row's scale * its weight block's scale), the scales' product being
// the same number in either order, so the bits should be the unswapped tiles'
// (test_gpu_grouped_gemm.py compares them). Cooperative, clusters of one: nothing to multicast at
// one tile of rows per expert. No SwiGLU epilogue (its gate and up pairs lie along N): the plain
// product only.
template <int TileRows>
using SwapTile = cute::Shape<cute::_128, cute::Int<TileRows>, cute::_128>;
template <int TileRows>
using SwapKernel =
    Fp8Kernel<SwapTile<TileRows>, GemmCluster<1, 1>, KernelScheduleOf<false>,
              StoreEpilogue<SwapTile<TileRows>, GemmCluster<1, 1>, EpilogueScheduleOf<false>,
                            cutlass::layout::ColumnMajor*>,
              SwapLayoutSFA, SwapLayoutSFB>;
template <int TileRows>
struct SwapGemm : SwapKernel<TileRows> {
  static constexpr bool kSwiGlu = false;
  static constexpr bool kSwapped = true;
  static_assert(
      cute::is_same_v<std::remove_pointer_t<
                          decltype(typename SwapKernel<TileRows>::Device::Arguments{}.epilogue.dD)>,
                      SwapStrideD>);
};

// ld_out: the SwiGLU kernel's elements between rows of out (I); unused by the store.
template <class G>
typename G::Device::Arguments arguments(const grouped::Workspace& ws, const Arrays& fa,
                                        int64_t num_experts, int device, int sm_count,
                                        int64_t ld_out = 0) {
  typename G::Device::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(num_experts), ws.shapes, nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const Fp8**>(ws.ptr_a);
  args.mainloop.dA = reinterpret_cast<typename G::StrideA*>(ws.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const Fp8**>(ws.ptr_b);
  args.mainloop.dB = reinterpret_cast<typename G::StrideB*>(ws.stride_b);
  args.mainloop.ptr_SFA = fa.ptr_sfa;
  args.mainloop.ptr_SFB = fa.ptr_sfb;
  if constexpr (G::kSwapped) {
    // The weights as A, the rows as B (build_fp8_problems); out^T's strides in the D slots.
    args.mainloop.layout_SFA = fa.swap_layout_sfa();
    args.mainloop.layout_SFB = fa.swap_layout_sfb();
  } else {
    args.mainloop.layout_SFA = fa.layout_sfa;
    if constexpr (G::kSwiGlu)
      args.mainloop.layout_SFB = fa.layout_sfb64();
    else
      args.mainloop.layout_SFB = fa.layout_sfb;
  }
  if constexpr (G::kSwiGlu) {
    args.epilogue.ptr_out = ws.ptr_d;
    args.epilogue.ld_out = ld_out;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
  } else {
    grouped::set_store_epilogue(args, ws, device, sm_count);
  }
  return args;
}

// One compiled configuration: its description and its entry points, as grouped_configs.hpp's
// GroupedEntry for the bf16 kernels. A swapped configuration (config.swapped, SwapGemm) has no
// run_swiglu and no run_f32, and its problems are written with the operands' roles swapped.
struct Entry {
  GroupedGemmConfig config;
  // CUTLASS's own workspace (per-SM TMA descriptors) for E groups on sm_count SMs.
  size_t (*gemm_workspace_bytes)(const grouped::Workspace& ws, const Arrays& fa,
                                 int64_t num_experts, int sm_count);
  // Runs the kernel over the problems build_fp8_problems wrote into ws and fa.
  Status (*run)(const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts, int device,
                int sm_count, cudaStream_t stream);
  // The same with the SwiGLU epilogue (w1 packed, out [R, n / 2] with ld_out = n / 2).
  Status (*run_swiglu)(const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts,
                       int64_t ld_out, int device, int sm_count, cudaStream_t stream);
  // run's product stored in fp32 (GroupedGemmFp8Problem::out_f32).
  Status (*run_f32)(const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts, int device,
                    int sm_count, cudaStream_t stream);
};

template <class G>
size_t gemm_workspace_bytes(const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts,
                            int sm_count) {
  return G::Device::get_workspace_size(arguments<G>(ws, fa, num_experts, 0, sm_count));
}

// CUTLASS's kernel body behind a grid-dependency wait: launched while the problem kernel ahead
// of it still runs (launch_after), so its launch latency overlaps that kernel instead of adding
// to a decode step's chain of short launches. CUTLASS's ptr-array kernels do not wait for a grid
// ahead themselves (its non-grouped sm90 kernels do), and they read the problem arrays that
// kernel writes from their first instructions (the scheduler's group walk), hence the wait
// before the body. The kernel behind may launch at once: it waits for this one's end.
template <class G>
__global__ void __launch_bounds__(G::Kernel::MaxThreadsPerBlock,
                                  G::Kernel::MinBlocksPerMultiprocessor)
    fp8_gemm_kernel(const __grid_constant__ typename G::Kernel::Params params) {
  extern __shared__ char smem[];
  wait_for_prior_grid();
  allow_next_grid();
  typename G::Kernel{}(params, smem);
}

template <class G>
Status launch_after(const typename G::Device::Arguments& args, void* workspace, cudaStream_t stream,
                    const char* what) {
  using Kernel = typename G::Kernel;
  typename Kernel::Params params;
  if (Status s = body_params<Kernel>(args, workspace, stream, what, &params); !s.ok()) return s;
  return launch_with_body<Kernel>(fp8_gemm_kernel<G>, params, stream, what, /*after_prior=*/true);
}

template <class G>
Status run(const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts, int device,
           int sm_count, cudaStream_t stream) {
  const typename G::Device::Arguments args = arguments<G>(ws, fa, num_experts, device, sm_count);
  return launch_after<G>(args, fa.gemm, stream, "the fp8 grouped GEMM");
}

template <class G>
Status run_swiglu(const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts,
                  int64_t ld_out, int device, int sm_count, cudaStream_t stream) {
  const typename G::Device::Arguments args =
      arguments<G>(ws, fa, num_experts, device, sm_count, ld_out);
  return launch_after<G>(args, fa.gemm, stream, "the fp8 grouped GEMM with SwiGLU");
}

// Every configuration is compiled three ways: the plain product (run), with the SwiGLU epilogue
// (run_swiglu) and the plain product in fp32 (run_f32).
template <int TileM, int ClusterM, int ClusterN, bool PingPong>
Entry make_entry(const char* name) {
  using G = Gemm<TileM, ClusterM, ClusterN, PingPong>;
  using GS = Gemm<TileM, ClusterM, ClusterN, PingPong, true>;
  using GF = Gemm<TileM, ClusterM, ClusterN, PingPong, false, float>;
  Entry e;
  e.config =
      GroupedGemmConfig{name, TileM, kBlock, kBlock, G::kStages, ClusterM, ClusterN, PingPong};
  e.gemm_workspace_bytes = [](const grouped::Workspace& ws, const Arrays& fa, int64_t num_experts,
                              int sm_count) {
    return std::max({gemm_workspace_bytes<G>(ws, fa, num_experts, sm_count),
                     gemm_workspace_bytes<GS>(ws, fa, num_experts, sm_count),
                     gemm_workspace_bytes<GF>(ws, fa, num_experts, sm_count)});
  };
  e.run = &run<G>;
  e.run_swiglu = &run_swiglu<GS>;
  e.run_f32 = &run<GF>;
  return e;
}

// The swapped configuration of TileRows rows a tile, described in the product's own terms: a
// tile of TileRows rows by 128 output columns.
template <int TileRows>
Entry make_swap_entry(const char* name) {
  using G = SwapGemm<TileRows>;
  Entry e;
  e.config = GroupedGemmConfig{name, TileRows, kBlock, kBlock, G::kStages, 1, 1, false, true};
  e.gemm_workspace_bytes = &gemm_workspace_bytes<G>;
  e.run = &run<G>;
  e.run_swiglu = nullptr;
  e.run_f32 = nullptr;
  return e;
}

const Entry& entry_coop_128x128x128();
const Entry& entry_pingpong_64x128x128();
const Entry& entry_swap_16x128x128();
const Entry& entry_swap_32x128x128();

}  // namespace uniep::cuda::grouped_fp8
