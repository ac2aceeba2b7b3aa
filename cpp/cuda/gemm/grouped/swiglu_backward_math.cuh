// SwiGLU's backward for one element, with torch's fp32 arithmetic operation by operation (each
// product and sum rounded on its own, no FMA contraction), so the gradients are those of the
// unfused chain. Shared by the one-pass kernel (expert_backward_rows.cu) and the data-gradient
// GEMM's epilogue (swiglu_backward_epilogue.cuh), so both give the same bits from the same h.
#pragma once

#include <cuda_bf16.h>

namespace uniep::cuda::grouped {

struct SwiGluBackwardValues {
  float act;     // silu(g) * u rounded to bf16, as the forward stored it
  float act_w;   // act * w: w2's weight-gradient operand
  float grad_g;  // the gate's gradient
  float grad_u;  // the up projection's gradient
};

// g, u: the forward's gate and up (bf16 values); ga: the activation's gradient before the
// routing weight (grad_out w2^T, a bf16 value); w: the row's routing weight. With gw = ga * w:
//   sig = 1 / (1 + exp(-g)); act = bf16(g * sig * u)
//   grad_g = gw * u * sig * (1 + g * (1 - sig)); grad_u = gw * g * sig
__device__ __forceinline__ SwiGluBackwardValues swiglu_backward_values(float g, float u, float ga,
                                                                       float w) {
  SwiGluBackwardValues out;
  const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
  out.act = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(g, sig), u)));
  out.act_w = __fmul_rn(out.act, w);
  const float gw = __fmul_rn(ga, w);
  const float dsilu = __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sig)));
  out.grad_g = __fmul_rn(__fmul_rn(__fmul_rn(gw, u), sig), dsilu);
  out.grad_u = __fmul_rn(__fmul_rn(gw, g), sig);
  return out;
}

}  // namespace uniep::cuda::grouped
