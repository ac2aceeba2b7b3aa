// One configuration's entry points (grouped_configs.hpp) from its CUTLASS type: the kernel's
// arguments over the workspace arrays the problem kernel fills, its workspace size, and the
// launch. Included by the sm90_grouped_<name>.cu files only, one instantiation each.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/gemm/cutlass_launch.cuh"
#include "cuda/gemm/grouped/grouped_configs.hpp"
#include "cuda/gemm/grouped/grouped_kernel.cuh"
#include "uniep/status.hpp"

namespace uniep::cuda::grouped {

// The shapes, pointers and strides are device arrays (set_problem_arrays). `plain`: kSwiGluPlain's
// w1 as stored, all E experts (PlainGateUpMainloop's own TMA reads it).
template <class G>
typename G::Gemm::Arguments grouped_arguments(const Workspace& ws, int64_t num_experts, int device,
                                              int sm_count, int64_t ld_out,
                                              const PlainW1& plain = {}) {
  typename G::Gemm::Arguments args{};
  set_problem_arrays<typename G::StrideA, typename G::StrideB>(args, ws, num_experts);
  if constexpr (G::kTmaStore) {
    set_store_epilogue(args, ws, device, sm_count);
  } else {
    args.epilogue.ptr_out = ws.ptr_d;
    args.epilogue.ld_out = ld_out;
    args.hw_info.device_id = device;
    args.hw_info.sm_count = sm_count;
  }
  if constexpr (G::kPlain) G::Mainloop::set_w1(args.mainloop, plain, num_experts);
  return args;
}

template <class G>
size_t grouped_gemm_workspace(int64_t num_experts, int sm_count) {
  // Depends on the SM count only (per-SM TMA descriptors); any aligned base gives the sizes.
  const Workspace ws = carve(reinterpret_cast<void*>(kWorkspaceAlign), num_experts);
  return G::Gemm::get_workspace_size(grouped_arguments<G>(ws, num_experts, 0, sm_count, 2));
}

// The launch; `plain` is kSwiGluPlain's w1, ignored by the other epilogues.
template <class G>
Status grouped_gemm_run_plain(const Workspace& ws, int64_t num_experts, int64_t ld_out, int device,
                              int sm_count, cudaStream_t stream, const PlainW1& plain) {
  const typename G::Gemm::Arguments args =
      grouped_arguments<G>(ws, num_experts, device, sm_count, ld_out, plain);
  return launch_cutlass<typename G::Gemm>(args, ws.gemm, stream, "the grouped GEMM");
}

template <class G>
Status grouped_gemm_run(const Workspace& ws, int64_t num_experts, int64_t ld_out, int device,
                        int sm_count, cudaStream_t stream) {
  return grouped_gemm_run_plain<G>(ws, num_experts, ld_out, device, sm_count, stream, PlainW1{});
}

template <int TileM, int TileN, int TileK, int ClusterM, int ClusterN, bool PingPong,
          GroupedKind Kind = GroupedKind::kForward>
GroupedEntry make_entry(const char* name) {
  using G = Sm90GroupedGemm<TileM, TileN, TileK, ClusterM, ClusterN, PingPong,
                            GroupedEpilogue::kStore, Kind>;
  GroupedEntry e;
  e.config = GroupedGemmConfig{name, TileM, TileN, TileK, G::kStages, ClusterM, ClusterN, PingPong};
  e.run = &grouped_gemm_run<G>;
  if constexpr (Kind == GroupedKind::kForward) {
    using GSwiGlu = Sm90GroupedGemm<TileM, TileN, TileK, ClusterM, ClusterN, PingPong,
                                    GroupedEpilogue::kSwiGlu, Kind>;
    using GPlain = Sm90GroupedGemm<TileM, TileN, TileK, ClusterM, ClusterN, PingPong,
                                   GroupedEpilogue::kSwiGluPlain, Kind>;
    using GF32 = Sm90GroupedGemm<TileM, TileN, TileK, ClusterM, ClusterN, PingPong,
                                 GroupedEpilogue::kStoreF32, Kind>;
    e.gemm_workspace_bytes = [](int64_t num_experts, int sm_count) {
      return std::max({grouped_gemm_workspace<G>(num_experts, sm_count),
                       grouped_gemm_workspace<GSwiGlu>(num_experts, sm_count),
                       grouped_gemm_workspace<GPlain>(num_experts, sm_count),
                       grouped_gemm_workspace<GF32>(num_experts, sm_count)});
    };
    e.run_swiglu = &grouped_gemm_run<GSwiGlu>;
    e.run_swiglu_plain = &grouped_gemm_run_plain<GPlain>;
    e.run_f32 = &grouped_gemm_run<GF32>;
  } else {
    e.gemm_workspace_bytes = &grouped_gemm_workspace<G>;
    e.run_swiglu = nullptr;
    e.run_swiglu_plain = nullptr;
    e.run_f32 = nullptr;
  }
  return e;
}

}  // namespace uniep::cuda::grouped
