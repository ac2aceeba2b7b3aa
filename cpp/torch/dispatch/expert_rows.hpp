// torch.ops.uniep.expert_rows: the grouped-GEMM row lists of a dispatch's received slots, on CPU
// (the planner, uniep::plan_experts) and CUDA (the dispatch's own kernels). The checks both
// implementations share live here; the CUDA implementation is in cuda_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torch/common/validate.hpp"

namespace uniep::torch_glue {

struct ExpertRowsDims {
  int64_t world_size, experts_per_rank, first_expert, top_k, slots;
};

// Shapes, dtypes and devices, and the integer arguments; reads no tensor values.
ExpertRowsDims check_expert_rows_args(const at::Tensor& recv_src, const at::Tensor& recv_topk_idx,
                                      const at::Tensor& recv_from_rank, int64_t rank,
                                      int64_t num_experts, int64_t max_tokens, Executor executor);

// The values: recv_from_rank sums to the slots and none is negative, every recv_src is in
// [0, max_tokens), every id in [-1, num_experts), and every slot names a local expert. Reads the
// tensors on the host (one copy for CUDA tensors, so not under graph capture).
void check_expert_rows_values(const at::Tensor& recv_src, const at::Tensor& recv_topk_idx,
                              const at::Tensor& recv_from_rank, int64_t num_experts,
                              int64_t max_tokens, const ExpertRowsDims& d);

// 0-d int64 on the tensors' device: nonzero when check_expert_rows_values would throw. Nothing is
// read on the host, so a caller can fold it into a copy it makes anyway.
at::Tensor expert_rows_input_flaw(const at::Tensor& recv_src, const at::Tensor& recv_topk_idx,
                                  const at::Tensor& recv_from_rank, int64_t num_experts,
                                  int64_t max_tokens, const ExpertRowsDims& d);

}  // namespace uniep::torch_glue
