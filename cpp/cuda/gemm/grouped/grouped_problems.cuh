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

#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"

namespace uniep::cuda::grouped {

// out_n: the columns of out (n, or n / 2 for the SwiGLU epilogue).
//
// One warp walks offs in chunks of 32 experts. Each end is clamped to [0, rows] and raised to the
// largest earlier end (a max-scan): the row ranges are then disjoint, ascending and inside x and
// out whatever offs holds, so a malformed offs can give wrong rows but never an access out of
// bounds or two experts writing one row. For a valid offs the clamp changes nothing.
__global__ void __launch_bounds__(32)
    build_grouped_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int k,
                           int n, int out_n, const Bf16* x, const Bf16* w, Bf16* out,
                           Workspace ws) {
  const int lane = static_cast<int>(threadIdx.x);
  int carry = 0;  // end of the last expert of the previous chunk
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    int end = e < num_experts ? min(max(offs[e], 0), rows) : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, end, d);
      if (lane >= d) end = max(end, v);
    }
    end = max(end, carry);
    int begin = __shfl_up_sync(0xffffffffu, end, 1);
    if (lane == 0) begin = carry;
    carry = __shfl_sync(0xffffffffu, end, 31);
    if (e < num_experts) {
      ws.shapes[e] = Shape{end - begin, n, k};
      ws.ptr_a[e] = x + static_cast<int64_t>(begin) * k;
      ws.ptr_b[e] = w + static_cast<int64_t>(e) * k * n;
      ws.ptr_d[e] = out + static_cast<int64_t>(begin) * out_n;
      ws.stride_a[e] = StrideA{static_cast<int64_t>(k), cute::_1{}, cute::_0{}};
      ws.stride_b[e] = StrideB{cute::_1{}, static_cast<int64_t>(n), cute::_0{}};
      ws.stride_d[e] = StrideD{static_cast<int64_t>(out_n), cute::_1{}, cute::_0{}};
    }
  }
}

}  // namespace uniep::cuda::grouped
