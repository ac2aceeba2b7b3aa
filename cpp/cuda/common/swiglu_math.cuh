// silu(g) * u in fp32 for every GPU path that forms the SwiGLU activation (the first expert
// GEMM's epilogue, the MegaKernel's, the one-pass swiglu_bf16 / swiglu_fp8 kernels), so w1
// packed, w1 as stored and the separate pass give the same bits.
//
// Why the approximate exp2 and reciprocal (one MUFU instruction each): with expf and an IEEE
// division the formula took ~40 instructions an element, run by the GEMM's consumer warps while
// the tensor cores wait. On one H100 the first GEMM of the DeepSeek-V3 EP8 rank ran 1.3-3.4%
// faster with this form, Mixtral's 2.0%, and the activation's bf16 bits differed from the IEEE
// form's in about 4 of 10^9 elements, rounded the other way (2026-11-28, commit 6e04540 with an
// A/B switch between the two forms).
// The CPU executor keeps std::exp and a division; the two agree within bf16 rounding, which is
// what the tests compare.
#pragma once

#include <cuda_runtime.h>

namespace uniep::cuda {

__device__ __forceinline__ float silu_mul(float g, float u) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + __expf(-g)));
  return g * r * u;
}

}  // namespace uniep::cuda
