// The problem kernel of the grouped GEMM: from offs (device memory) to the per-expert problem
// shapes, operand pointers and strides the CUTLASS grouped kernel reads, written into the
// caller's workspace on the caller's stream. The same for every configuration.
//
// Why on the device: the row counts come out of the dispatch, on the GPU. Building the shapes on
// the host would need a copy of offs back and a stream synchronize per layer; that stalls the
// host's launch queue behind the dispatch, forbids CUDA graph capture, and is exactly the bubble
// the MegaKernel exists to remove. The host passes only E and R (the most rows there can be); the
// grouped kernel's tile scheduler reads the shapes from global memory as it walks the groups.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped/expert_problem.cuh"
#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"

namespace uniep::cuda::grouped {

// Group e is expert e's product of kind Kind (set_expert_problem says what each kind reads and
// writes; k and n are the GEMM's K and N for kForward and kDgrad, the output's rows and columns
// for kWgrad; out_n the columns of out). One warp walks the experts (for_each_expert_rows).
// Out: bf16, or fp32 for the fp32 store epilogue (kForward).
template <GroupedKind Kind, class Out>
__global__ void __launch_bounds__(32)
    build_grouped_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int k,
                           int n, int out_n, const Bf16* x, const Bf16* w, Out* out, Workspace ws) {
  for_each_expert_rows(
      offs, num_experts, rows, static_cast<int>(threadIdx.x),
      [&](int e, ExpertRows r) { set_expert_problem<Kind>(ws, e, e, r, k, n, out_n, x, w, out); });
}

// kWgrad: out[e] = 0 for every expert with no rows (the GEMM gives it no tiles, and a sum over
// no rows is zero). Grid (E, chunks); 16-byte stores. Static: this header is included by more
// than one translation unit (the engine and the gated GEMM).
static __global__ void zero_empty_wgrad(const Shape* __restrict__ shapes, int64_t kn, Bf16* out) {
  const int e = static_cast<int>(blockIdx.x);
  if (cute::get<0>(shapes[e]) != 0) return;
  uint4* dst = reinterpret_cast<uint4*>(out + static_cast<int64_t>(e) * kn);
  const int64_t vecs = kn / 8;
  for (int64_t i = blockIdx.y * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x)
    dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace uniep::cuda::grouped
