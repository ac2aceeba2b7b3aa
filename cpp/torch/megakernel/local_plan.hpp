// uniep::local_plan's CUDA body, for the ops that plan a world-1 layer themselves
// (torch/ep/local_layer.cpp). CUDA builds only; defined in send_rows_cuda_ops.cpp.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "torch/megakernel/send_rows_ops.hpp"

namespace uniep::torch_glue {

// uniep::local_plan on `stream` after check_expert_tiles_args; throws uniep::Error.
LocalPlanTensors local_plan_on_stream(const at::Tensor& topk_idx, int64_t num_experts,
                                      int64_t tile_m, cudaStream_t stream);

}  // namespace uniep::torch_glue
