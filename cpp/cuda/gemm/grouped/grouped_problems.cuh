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

#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"

namespace uniep::cuda::grouped {

// What each kind reads and writes, from one expert's rows [begin, end) (k and n are the GEMM's K
// and N for kForward and kDgrad, the output's rows and columns for kWgrad):
//   kForward  x [R, k], w [E, k, n], out [R, out_n]:  M = rows, A = x rows, B = w[e], D = out rows
//   kDgrad    x = dy [R, k], w [E, n, k], out [R, n]:  M = rows, B = w[e]^T (K-major)
//   kWgrad    x [R, k], w = dy [R, n], out [E, k, n]:  M = k, N = n, K = rows; an expert with no
//             rows gets no tiles (M = 0) and zero_empty_wgrad clears its out[e].
// out_n: the columns of out (n, or n / 2 for the SwiGLU epilogue). One warp walks the experts
// (expert_rows_step).
template <GroupedKind Kind>
__global__ void __launch_bounds__(32)
    build_grouped_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int k,
                           int n, int out_n, const Bf16* x, const Bf16* w, Bf16* out,
                           Workspace ws) {
  const int lane = static_cast<int>(threadIdx.x);
  int carry = 0;  // end of the last expert of the previous chunk
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    const ExpertRows r = expert_rows_step(offs, e, num_experts, rows, lane, carry);
    if (e >= num_experts) continue;
    const int m = r.end - r.begin;
    const int64_t b = r.begin, ee = e;
    if constexpr (Kind == GroupedKind::kWgrad) {
      ws.shapes[e] = Shape{m > 0 ? k : 0, n, m};
      ws.ptr_a[e] = x + b * k;
      ws.ptr_b[e] = w + b * n;
      ws.ptr_d[e] = out + ee * k * n;
      ws.stride_a[e] = k;  // x^T: M (the columns of x) contiguous, K (its rows) k apart
      ws.stride_b[e] = n;  // dy: N contiguous, K (its rows) n apart
      ws.stride_d[e] = StrideD{static_cast<int64_t>(n), cute::_1{}, cute::_0{}};
    } else {
      ws.shapes[e] = Shape{m, n, k};
      ws.ptr_a[e] = x + b * k;
      ws.ptr_b[e] = w + ee * k * n;
      ws.ptr_d[e] = out + b * out_n;
      ws.stride_a[e] = k;  // x rows: K contiguous, M k apart
      // kForward: w[e] [k, n], N contiguous, K n apart; kDgrad: w[e] [n, k], K contiguous, N
      // k apart.
      ws.stride_b[e] = Kind == GroupedKind::kForward ? n : k;
      ws.stride_d[e] = StrideD{static_cast<int64_t>(out_n), cute::_1{}, cute::_0{}};
    }
  }
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
