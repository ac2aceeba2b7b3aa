// The problem kernel of the grouped GEMM: from offs (device memory) to the per-expert problem
// shapes, operand pointers and strides the CUTLASS grouped kernel reads, written into the
// caller's workspace on the caller's stream.
//
// Why on the device: the row counts come out of the dispatch, on the GPU. Building the shapes on
// the host would need a copy of offs back and a stream synchronize per layer; that stalls the
// host's launch queue behind the dispatch, forbids CUDA graph capture, and is exactly the bubble
// the MegaKernel exists to remove. The host passes only E and R (the most rows there can be); the
// grouped kernel's tile scheduler reads the shapes from global memory as it walks the groups.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/grouped/sm90_grouped_gemm_kernel.cuh"

namespace uniep::cuda::grouped {

using G = Sm90Bf16GroupedGemm;

// The workspace: E entries of each per-group array, then CUTLASS's own workspace (its per-SM TMA
// descriptors). Every piece starts on a 256-byte boundary (CUTLASS wants 64 for descriptors;
// 256 keeps each array in whole cache lines).
struct Workspace {
  typename G::Shape* shapes = nullptr;
  const G::Bf16** ptr_a = nullptr;
  const G::Bf16** ptr_b = nullptr;
  G::Bf16** ptr_d = nullptr;
  G::StrideA* stride_a = nullptr;
  G::StrideB* stride_b = nullptr;
  G::StrideD* stride_d = nullptr;
  void* gemm = nullptr;
};

constexpr size_t kWorkspaceAlign = 256;

inline size_t round_up(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Bytes before the CUTLASS workspace for E groups.
inline size_t group_arrays_bytes(int64_t num_experts) {
  const size_t e = static_cast<size_t>(num_experts);
  return round_up(e * sizeof(G::Shape)) + 3 * round_up(e * sizeof(void*)) +
         round_up(e * sizeof(G::StrideA)) + round_up(e * sizeof(G::StrideB)) +
         round_up(e * sizeof(G::StrideD));
}

// The pieces of a workspace at `base` (256-byte aligned) for E groups.
inline Workspace carve(void* base, int64_t num_experts) {
  const size_t e = static_cast<size_t>(num_experts);
  char* p = static_cast<char*>(base);
  auto take = [&p](size_t bytes) {
    char* at = p;
    p += round_up(bytes);
    return at;
  };
  Workspace ws;
  ws.shapes = reinterpret_cast<typename G::Shape*>(take(e * sizeof(G::Shape)));
  ws.ptr_a = reinterpret_cast<const G::Bf16**>(take(e * sizeof(void*)));
  ws.ptr_b = reinterpret_cast<const G::Bf16**>(take(e * sizeof(void*)));
  ws.ptr_d = reinterpret_cast<G::Bf16**>(take(e * sizeof(void*)));
  ws.stride_a = reinterpret_cast<G::StrideA*>(take(e * sizeof(G::StrideA)));
  ws.stride_b = reinterpret_cast<G::StrideB*>(take(e * sizeof(G::StrideB)));
  ws.stride_d = reinterpret_cast<G::StrideD*>(take(e * sizeof(G::StrideD)));
  ws.gemm = p;
  return ws;
}

// One warp walks offs in chunks of 32 experts. Each end is clamped to [0, rows] and raised to the
// largest earlier end (a max-scan): the row ranges are then disjoint, ascending and inside x and
// out whatever offs holds, so a malformed offs can give wrong rows but never an access out of
// bounds or two experts writing one row. For a valid offs the clamp changes nothing.
__global__ void __launch_bounds__(32)
    build_grouped_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int k,
                           int n, const G::Bf16* x, const G::Bf16* w, G::Bf16* out, Workspace ws) {
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
      ws.shapes[e] = typename G::Shape{end - begin, n, k};
      ws.ptr_a[e] = x + static_cast<int64_t>(begin) * k;
      ws.ptr_b[e] = w + static_cast<int64_t>(e) * k * n;
      ws.ptr_d[e] = out + static_cast<int64_t>(begin) * n;
      ws.stride_a[e] = G::StrideA{static_cast<int64_t>(k), cute::_1{}, cute::_0{}};
      ws.stride_b[e] = G::StrideB{cute::_1{}, static_cast<int64_t>(n), cute::_0{}};
      ws.stride_d[e] = G::StrideD{static_cast<int64_t>(n), cute::_1{}, cute::_0{}};
    }
  }
}

}  // namespace uniep::cuda::grouped
