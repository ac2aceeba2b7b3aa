// One group's entry in the problem arrays the grouped kernels read (Workspace): its (M, N, K),
// operand pointers and strides, from one expert's rows. Every problem kernel writes its groups
// through here: the engine's (grouped_problems.cuh), the fp8 engine's (sm90_grouped_fp8.cu) and
// the MegaKernel's forward and backward, whose 2E groups are two of these per expert
// (megakernel/problems.cuh).
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"

namespace uniep::cuda::grouped {

// Group `group` of ws gets expert `expert`'s rows [begin, end) in the product of its kind (k and
// n are the GEMM's K and N for kForward and kDgrad, the output's rows and columns for kWgrad):
//   kForward  x [R, k], w [E, k, n], out [R, out_n]:  M = rows, A = x rows, B = w[e], D = out rows
//   kDgrad    x = dy [R, k], w [E, n, k], out [R, n]:  M = rows, B = w[e]^T (K-major)
//   kWgrad    x [R, k], w = dy [R, n], out [E, k, n]:  M = k, N = n, K = rows; an expert with no
//             rows gets no tiles (M = 0) and zero_empty_wgrad clears its out[e].
// out_n: the columns of out (n, or n / 2 for the SwiGLU epilogue). ElementA and ElementB are
// bf16, or e4m3 for the fp8 kernels (whose w [E, n, k] is K-major, as kDgrad's), and Out bf16,
// or fp32 for the fp32 store epilogue: the pointers step in their own elements and sit in the
// workspace's bf16 slots, which those kernels cast back.
template <GroupedKind Kind, class ElementA, class ElementB, class Out>
__device__ __forceinline__ void set_expert_problem(const Workspace& ws, int group, int expert,
                                                   ExpertRows rows, int k, int n, int out_n,
                                                   const ElementA* x, const ElementB* w, Out* out) {
  const int m = rows.end - rows.begin;
  const int64_t b = rows.begin, ee = expert;
  if constexpr (Kind == GroupedKind::kWgrad) {
    ws.shapes[group] = Shape{m > 0 ? k : 0, n, m};
    ws.ptr_a[group] = reinterpret_cast<const Bf16*>(x + b * k);
    ws.ptr_b[group] = reinterpret_cast<const Bf16*>(w + b * n);
    ws.ptr_d[group] = reinterpret_cast<Bf16*>(out + ee * k * n);
    ws.stride_a[group] = k;  // x^T: M (the columns of x) contiguous, K (its rows) k apart
    ws.stride_b[group] = n;  // dy: N contiguous, K (its rows) n apart
    ws.stride_d[group] = StrideD{static_cast<int64_t>(n), cute::_1{}, cute::_0{}};
  } else {
    ws.shapes[group] = Shape{m, n, k};
    ws.ptr_a[group] = reinterpret_cast<const Bf16*>(x + b * k);
    ws.ptr_b[group] = reinterpret_cast<const Bf16*>(w + ee * k * n);
    ws.ptr_d[group] = reinterpret_cast<Bf16*>(out + b * out_n);
    ws.stride_a[group] = k;  // x rows: K contiguous, M k apart
    // kForward: w[e] [k, n], N contiguous, K n apart; kDgrad: w[e] [n, k], K contiguous, N
    // k apart.
    ws.stride_b[group] = Kind == GroupedKind::kForward ? n : k;
    ws.stride_d[group] = StrideD{static_cast<int64_t>(out_n), cute::_1{}, cute::_0{}};
  }
}

}  // namespace uniep::cuda::grouped
