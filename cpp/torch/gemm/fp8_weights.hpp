// Expert weights in the fp8 experts' format, as tensors on any device (built without CUDA too):
// the ops uniep::quantize_expert_weights, uniep::pack_gate_up_fp8 and unpack_gate_up_fp8
// (uniep.gemm's functions of the same names) and the e4m3 copy moe_forward keeps of bf16 weights
// (fp8_experts.cpp). The packed layout is uniep/fp8_weights.hpp's, the host functions a C++ server
// uses.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace uniep::torch_glue {

// w [E, K, N] (K and N multiples of 128; any float dtype) -> (e4m3 [E, N, K] K-major, fp32 scales
// [E, K / 128, N / 128]): per 128 x 128 block, scale amax / 448 and the values times
// amax.reciprocal() * 448 (torch's `448 / amax`) clamped to +-448 and rounded to e4m3.
std::pair<at::Tensor, at::Tensor> quantize_expert_weights(const at::Tensor& w);

// The quantized w1 [E, 2I, K] e4m3 and its scales [E, K / 128, 2I / 128] packed for the first fp8
// GEMM's SwiGLU epilogue (uniep::gate_up_source_row, gate_up_source_block): contiguous
// ([E, 2I, K], [E, K / 128, 2I / 64]). I must be a multiple of 64.
std::pair<at::Tensor, at::Tensor> pack_gate_up_fp8(const at::Tensor& q1, const at::Tensor& s1);

// The inverse of pack_gate_up_fp8: q [E, 2I, K] and s [E, K / 128, 2I / 64] -> w1's rows as
// stored (gate, then up) and a scale per 128 x 128 block.
std::pair<at::Tensor, at::Tensor> unpack_gate_up_fp8(const at::Tensor& q, const at::Tensor& s);

}  // namespace uniep::torch_glue
