// The gated grouped GEMM (include/uniep/cuda/tile_gate.hpp): the engine's cooperative
// 128 x 256 x 64 configuration with GatedMainloop in place of CUTLASS's mainloop (around the
// engine's PlainGateUpMainloop for kSwiGluPlain). Included by sm90_gated_store.cu,
// sm90_gated_swiglu.cu and sm90_gated_swiglu_plain.cu, one epilogue each; the store epilogue
// also at 128 x 128 (sm90_gated_store_n128.cu: the part GEMM's tile where the 256-wide tiles
// would leave much of the last wave idle). The gate counts row blocks of kGatedTileM rows, so
// the tile's width is free.
#pragma once

#include <cuda_runtime.h>

#include "cuda/gemm/cutlass_launch.cuh"
#include "cuda/gemm/grouped/grouped_configs.hpp"
#include "cuda/gemm/grouped/grouped_kernel.cuh"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "cuda/megakernel/gated_mainloop.cuh"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::cuda::megakernel {

// The gate's tile: it must be the GEMM's, since a counter stands for one output row block.
static_assert(kGatedTileM == 128, "the gated configuration is the 128-row cooperative tile");

template <grouped::GroupedEpilogue Epi, int TileN = kGatedTileN>
struct GatedGemm {
  using Plain = grouped::Sm90GroupedGemm<kGatedTileM, TileN, 64, 2, 1, false, Epi>;
  using Mainloop = GatedMainloop<typename Plain::Mainloop, kGatedTileM>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<grouped::ProblemShape, Mainloop,
                                                      typename Plain::Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static_assert(cute::is_same_v<typename Kernel::InternalStrideA, grouped::KMajorA>);
  static_assert(cute::is_same_v<typename Kernel::InternalStrideB, grouped::NMajorB>);
};

// The order in which the persistent CTAs take the tiles of a group: CUTLASS's group scheduler
// walks them along M (its default: every m-tile of an n-column, then the next column), or along
// N, in bands of `swizzle` tiles (1, 2, 4 or 8).
struct GatedOrder {
  int swizzle = 1;
  bool along_n = false;
};

template <grouped::GroupedEpilogue Epi, int TileN = kGatedTileN>
typename GatedGemm<Epi, TileN>::Gemm::Arguments gated_arguments(
    const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
    const GatedSignal& signal, int device, int sm_count, int64_t ld_out,
    const grouped::PlainW1& plain = {}, const GatedOrder& order = {}) {
  using G = GatedGemm<Epi, TileN>;
  using Raster = typename G::Kernel::TileScheduler::RasterOrderOptions;
  typename G::Gemm::Arguments args{};
  grouped::set_problem_arrays<grouped::KMajorA, grouped::NMajorB>(args, ws, num_experts);
  args.scheduler.max_swizzle_size = order.swizzle;
  args.scheduler.raster_order = order.along_n ? Raster::AlongN : Raster::AlongM;
  args.mainloop.gate = gate;
  if constexpr (Epi == grouped::GroupedEpilogue::kSwiGluPlain)
    G::Mainloop::set_w1(args.mainloop, plain, num_experts);
  if constexpr (Epi != grouped::GroupedEpilogue::kStore) {
    args.epilogue.ptr_out = ws.ptr_d;
    args.epilogue.ld_out = ld_out;
    args.epilogue.done = signal.done;
    args.epilogue.done_base = signal.done_base;
    args.epilogue.num_done = signal.num_done;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
  } else {
    grouped::set_store_epilogue(args, ws, device, sm_count);
  }
  return args;
}

template <grouped::GroupedEpilogue Epi, int TileN = kGatedTileN>
size_t gated_gemm_workspace(int64_t num_experts, int sm_count) {
  const grouped::Workspace ws =
      grouped::carve(reinterpret_cast<void*>(grouped::kWorkspaceAlign), num_experts);
  return GatedGemm<Epi, TileN>::Gemm::get_workspace_size(
      gated_arguments<Epi, TileN>(ws, num_experts, TileGate{}, GatedSignal{}, 0, sm_count, 2));
}

template <grouped::GroupedEpilogue Epi, int TileN = kGatedTileN>
Status gated_gemm_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                      const GatedSignal& signal, int64_t ld_out, int device, int sm_count,
                      cudaStream_t stream, const grouped::PlainW1& plain = {},
                      const GatedOrder& order = {}) {
  const auto args = gated_arguments<Epi, TileN>(ws, num_experts, gate, signal, device, sm_count,
                                                ld_out, plain, order);
  return launch_cutlass<typename GatedGemm<Epi, TileN>::Gemm>(args, ws.gemm, stream,
                                                              "the gated grouped GEMM");
}

// One per epilogue, each defined in its own translation unit.
size_t gated_store_workspace(int64_t num_experts, int sm_count);
Status gated_store_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                       int device, int sm_count, cudaStream_t stream, const GatedOrder& order = {});
// The same at 128 x 128 tiles (the same bits: no tile splits k).
size_t gated_store_n128_workspace(int64_t num_experts, int sm_count);
Status gated_store_n128_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                            int device, int sm_count, cudaStream_t stream, const GatedOrder& order);
size_t gated_swiglu_workspace(int64_t num_experts, int sm_count);
Status gated_swiglu_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                        const GatedSignal& signal, int64_t ld_out, int device, int sm_count,
                        cudaStream_t stream);
// kStoreSignal: the parts GEMM of a GEMM + reduce-scatter (part_gemm.hpp's done counters).
size_t gated_store_signal_workspace(int64_t num_experts, int sm_count);
Status gated_store_signal_run(const grouped::Workspace& ws, int64_t num_experts,
                              const TileGate& gate, const GatedSignal& signal, int64_t ld_out,
                              int device, int sm_count, cudaStream_t stream,
                              const GatedOrder& order);
size_t gated_swiglu_plain_workspace(int64_t num_experts, int sm_count);
Status gated_swiglu_plain_run(const grouped::Workspace& ws, int64_t num_experts,
                              const TileGate& gate, const GatedSignal& signal, int64_t ld_out,
                              int device, int sm_count, cudaStream_t stream,
                              const grouped::PlainW1& plain);

}  // namespace uniep::cuda::megakernel
