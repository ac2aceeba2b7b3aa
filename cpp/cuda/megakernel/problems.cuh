// The problem arrays of the MegaKernel's one grouped GEMM over 2E groups, forward
// (sm90_forward.cu) and backward (sm90_backward.cu) alike: group e is expert e's first
// GEMM, group E + e its second, each the engine's kForward product of the expert's rows
// (set_expert_problem). GEMM 1's groups come first so that the persistent scheduler hands out
// every GEMM-1 tile before any GEMM-2 tile (kernel.cuh says why the waits need that order).
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped/expert_problem.cuh"
#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"

namespace uniep::cuda::megakernel {

// One of the two GEMMs: x rows [R, k] times w [E, k, n] into out [R, out_n] (out_n = n, or n / 2
// where the SwiGLU epilogue halves the columns).
struct FusedGemmOperands {
  const grouped::Bf16* x = nullptr;
  const grouped::Bf16* w = nullptr;
  grouped::Bf16* out = nullptr;
  int k = 0, n = 0, out_n = 0;
};

// Expert e's two groups: e of `first`, E + e of `second`, over its rows r.
__device__ __forceinline__ void set_fused_expert_problems(int e, int num_experts,
                                                          grouped::ExpertRows r,
                                                          const grouped::Workspace& ws,
                                                          const FusedGemmOperands& first,
                                                          const FusedGemmOperands& second) {
  grouped::set_expert_problem<grouped::GroupedKind::kForward>(
      ws, e, e, r, first.k, first.n, first.out_n, first.x, first.w, first.out);
  grouped::set_expert_problem<grouped::GroupedKind::kForward>(
      ws, e + num_experts, e, r, second.k, second.n, second.out_n, second.x, second.w, second.out);
}

// Groups [0, E) `first`, groups [E, 2E) `second`, over the experts' rows in offs (clamped to
// [0, rows]). One warp; every lane calls it.
__device__ __forceinline__ void set_fused_problems(const int32_t* __restrict__ offs,
                                                   int num_experts, int rows, int lane,
                                                   const grouped::Workspace& ws,
                                                   const FusedGemmOperands& first,
                                                   const FusedGemmOperands& second) {
  grouped::for_each_expert_rows(offs, num_experts, rows, lane, [&](int e, grouped::ExpertRows r) {
    set_fused_expert_problems(e, num_experts, r, ws, first, second);
  });
}

}  // namespace uniep::cuda::megakernel
