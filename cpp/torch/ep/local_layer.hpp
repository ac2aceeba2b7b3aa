// moe_forward and moe_backward at world 1 without the expert-parallel runtime's round: with every
// expert on this GPU the rows need no exchange, so the routing's plan on the device
// (plan_local_rows_async) says where each (token, k) row goes, and nothing waits for the host to
// read the counts. CUDA builds only.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <tuple>

#include "uniep/tuning.hpp"

namespace uniep::torch_glue {

// Whether moe_forward and the engine's moe_backward take the paths below for a call at this
// world size: world 1, bf16 x, the engine's bf16 GEMMs (gemm=uniep, bf16 experts), bf16 dispatch
// and the per-k combine. The other numerics and engines keep the runtime's path.
bool local_layer_takes(int64_t world_size, const at::Tensor& x, const TuningParams& params);

// The layer on operands moe_forward has checked (x [T, H] bf16, topk_idx [T, K] int64 with -1
// for an unused entry, topk_weights [T, K] fp32, w1 [E, H, 2I], w2 [E, I, H], all on x's device):
//
//   1. plan_local_rows_async: each expert's count and row end, and each entry's GEMM row (every
//      expert's rows in (token, k) order: the order of the dispatch at world 1);
//   2. store_token_rows_async: each token's row read once and stored at its entries' rows;
//   3. the engine's SwiGLU GEMM and second GEMM on the device's row ends (the buffer holds T x K
//      rows whatever the routing; rows past the last expert's end are neither computed nor read);
//   4. combine_rows_bf16: the per-k combine's arithmetic (ascending k, fp32, one rounding).
//
// The same rows in the same order, the same GEMMs and the combine's arithmetic: the bits of the
// runtime's path. The plan's error word is copied to the host behind step 1 and read once every
// step is enqueued, so the host waits only for the plan; an expert id outside [-1, E) raises
// (kInvalidArgument) naming the entry and its id, as the dispatch does.
at::Tensor local_moe_forward(const at::Tensor& x, const at::Tensor& topk_idx,
                             const at::Tensor& topk_weights, const at::Tensor& w1,
                             const at::Tensor& w2, const TuningParams& params, cudaStream_t stream);

// Whether moe_forward takes local_moe_forward_fp8 for a call at this world size: world 1, bf16
// x, the engine's fp8 GEMMs on the fp8 dispatch's rows (dispatch=fp8 with experts auto or fp8)
// and the per-k combine. (The backward of that layer is the bf16 layer's on the dispatched
// rows, rounded to e4m3: it keeps the runtime's path.)
bool local_fp8_forward_takes(int64_t world_size, const at::Tensor& x, const TuningParams& params);

// The fp8 layer on the same plan: each token quantized once in the fp8 dispatch's encoding and
// stored at its entries' rows (quantize_fp8_rows), the two fp8 GEMMs of fp8_experts_forward
// (torch/gemm/fp8_experts.hpp: the weights' e4m3 copy kept), the per-k combine. The rows, GEMMs
// and combine of the runtime's fp8 path, so its bits, which are uniep.moe.prepared's fp8
// experts'. Raises as local_moe_forward.
at::Tensor local_moe_forward_fp8(const at::Tensor& x, const at::Tensor& topk_idx,
                                 const at::Tensor& topk_weights, const at::Tensor& w1,
                                 const at::Tensor& w2, const TuningParams& params,
                                 cudaStream_t stream);

// moe_backward_engine's outputs on the same plan: x's and grad_out's rows stored at their GEMM
// rows, then the runtime path's GEMMs, element-wise pass and combine (unit weights) on them, so
// its bits. The routing weights' dots come per entry ([T * K], 0 for an unused one) with the
// identity as row_target, which the caller's scatter to the slots (uniep.moe.ep.rows_to_slots at
// world 1) takes as it takes rows. Raises as local_moe_forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> local_moe_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& topk_idx,
    const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w2,
    const TuningParams& params, cudaStream_t stream);

}  // namespace uniep::torch_glue
