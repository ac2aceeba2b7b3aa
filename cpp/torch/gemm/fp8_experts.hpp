// The experts of tuning experts=fp8 (dispatch=fp8's default) on CUDA: the bf16 weights quantized
// to e4m3 in 128 x 128 blocks, kept while the weights are unchanged, and the layer's two fp8
// GEMMs on the rows as the fp8 dispatch delivered them.
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "uniep/tuning.hpp"

namespace uniep::torch_glue {

// The layer's experts on fp8 rows: rows [R, H] e4m3 with row_scales [R, H / 128] in expert
// order (offs [E] int32, the cumulative row ends), w1 [E, H, 2I] and w2 [E, I, H] bf16 ->
// y [R, H] bf16 = fp8 GEMM(fp8 SwiGLU(fp8 GEMM(rows, w1)), w2) (y_f32: fp32, the second GEMM's
// accumulator as is, for combine=rank_partials). The quantized w1 and w2 are
// kept between calls (one e4m3 copy of each: half their bf16 size) while the tensors live and
// their version counters and data pointers stay the same; inside a CUDA graph's capture they
// are quantized in the call.
at::Tensor fp8_experts_forward(const at::Tensor& rows, const at::Tensor& row_scales,
                               const at::Tensor& offs, const at::Tensor& w1, const at::Tensor& w2,
                               const TuningParams& tuning, bool y_f32 = false);

// Drops every kept quantized copy (after writes the version counter does not see).
void clear_fp8_experts();

}  // namespace uniep::torch_glue
