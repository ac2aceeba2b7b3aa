// CPU implementations of the uniep ops: the CPU executor over a gloo process group.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "torch/common/call_checks.hpp"
#include "torch/common/process_group.hpp"
#include "torch/common/validate.hpp"
#include "uniep/cpu_executor.hpp"
#include "uniep/plan.hpp"
#include "uniep/tuning.hpp"

namespace uniep::torch_glue {
namespace {

// Element strides of a strided w1 / w2, read in place by the executor (zero: contiguous).
WeightStrides strides_of(const at::Tensor& w) {
  if (w.is_contiguous()) return {};
  return {w.stride(0), w.stride(1), w.stride(2)};
}

MoeForwardArgs forward_args(const at::Tensor& x, const at::Tensor& topk_idx,
                            const at::Tensor& topk_weights, const at::Tensor& w1,
                            const at::Tensor& w2, const std::string& tuning, const Group& group) {
  const TuningParams params = TuningParams::parse(tuning);
  const MoeInputs in = validate_moe_inputs(x, topk_idx, topk_weights, w1, w2, group.world_size,
                                           group.rank, Executor::kCpu);
  UNIEP_CHECK(x.device().is_cpu(), "x must be a CPU tensor for the CPU executor, got ", x.device());
  MoeForwardArgs args;
  args.x = x.data_ptr();
  args.topk_idx = topk_idx.data_ptr<int64_t>();
  args.topk_weights = topk_weights.data_ptr();
  args.w1 = w1.data_ptr();
  args.w2 = w2.data_ptr();
  args.w1_strides = strides_of(w1);
  args.w2_strides = strides_of(w2);
  args.dtype = in.dtype;
  args.weight_dtype = in.weight_dtype;
  args.shape = in.shape;
  args.shape.ranks_per_node = group.ranks_per_node;
  args.shape.validate();
  args.tuning = params;
  return args;
}

std::unique_ptr<Transport> make_transport(const Group& group, CallKind kind) {
  if (!group.pg) return std::make_unique<LocalTransport>();
  return std::make_unique<ProcessGroupTransport>(group.pg, call_kind_name(kind));
}

CallSignature signature_of(CallKind kind, const MoeForwardArgs& a) {
  return moe_signature(kind, a.dtype, a.weight_dtype, a.shape, a.tuning);
}

at::Tensor moe_forward_cpu(const at::Tensor& x, const at::Tensor& topk_idx,
                           const at::Tensor& topk_weights, const at::Tensor& w1,
                           const at::Tensor& w2, c10::string_view group_name,
                           c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const Group group = resolve_group(std::string(group_name));
    MoeForwardArgs args;
    check_and_agree(group, CallKind::kMoeForward, x.device(), [&] {
      args = forward_args(x, topk_idx, topk_weights, w1, w2, std::string(tuning), group);
      return signature_of(CallKind::kMoeForward, args);
    });
    at::Tensor out = at::empty_like(x);
    args.out = out.data_ptr();
    auto transport = make_transport(group, CallKind::kMoeForward);
    cpu_moe_forward(args, *transport);
    return out;
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& topk_idx,
    const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w2,
    c10::string_view group_name, c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const Group group = resolve_group(std::string(group_name));
    MoeBackwardArgs args;
    // Autograd may hand over a non-contiguous or expanded gradient; the executor needs rows.
    const at::Tensor go = grad_out.contiguous();
    check_and_agree(group, CallKind::kMoeBackward, x.device(), [&] {
      args.fwd = forward_args(x, topk_idx, topk_weights, w1, w2, std::string(tuning), group);
      check_like(go, "grad_out", x, "x");
      return signature_of(CallKind::kMoeBackward, args.fwd);
    });
    at::Tensor grad_x = at::empty_like(x), grad_w = at::empty_like(topk_weights);
    // Contiguous whatever w1 / w2's strides: the executor writes them row-major.
    at::Tensor grad_w1 = at::empty(w1.sizes(), w1.options());
    at::Tensor grad_w2 = at::empty(w2.sizes(), w2.options());
    args.grad_out = go.data_ptr();
    args.grad_x = grad_x.data_ptr();
    args.grad_topk_weights = grad_w.data_ptr();
    args.grad_w1 = grad_w1.data_ptr();
    args.grad_w2 = grad_w2.data_ptr();
    auto transport = make_transport(group, CallKind::kMoeBackward);
    cpu_moe_backward(args, *transport);
    return std::make_tuple(grad_x, grad_w, grad_w1, grad_w2);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> routing_layout_cpu(const at::Tensor& topk_idx,
                                                                  int64_t num_experts,
                                                                  int64_t world_size) {
  return translate_errors([&] {
    check_topk_idx(topk_idx);
    UNIEP_CHECK(topk_idx.device().is_cpu(), "topk_idx must be a CPU tensor here, got ",
                topk_idx.device());
    MoeShape shape;
    shape.tokens = topk_idx.size(0);
    shape.hidden = 1;
    shape.ffn_hidden = 1;
    shape.top_k = topk_idx.size(1);
    shape.num_experts = num_experts;
    shape.world_size = world_size;
    const RoutingLayout layout = compute_layout(topk_idx.data_ptr<int64_t>(), shape);
    auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor per_rank = at::empty({world_size}, i64);
    at::Tensor per_expert = at::empty({num_experts}, i64);
    at::Tensor in_rank =
        at::empty({shape.tokens, world_size}, at::TensorOptions().dtype(at::kBool));
    std::copy(layout.tokens_per_rank.begin(), layout.tokens_per_rank.end(),
              per_rank.data_ptr<int64_t>());
    std::copy(layout.tokens_per_expert.begin(), layout.tokens_per_expert.end(),
              per_expert.data_ptr<int64_t>());
    bool* flags = in_rank.data_ptr<bool>();
    for (size_t i = 0; i < layout.token_in_rank.size(); ++i)
      flags[i] = layout.token_in_rank[i] != 0;
    return std::make_tuple(per_rank, per_expert, in_rank);
  });
}

// The executor-independent reference of the device's gate_tile_base (cpp/core/schedule.cpp).
at::Tensor gate_tile_base_cpu(const at::Tensor& offs, int64_t rows, int64_t tile_m) {
  return translate_errors([&] {
    UNIEP_CHECK(offs.dim() == 1 && offs.size(0) >= 1,
                "offs must be 1-D with at least one expert, got shape ", offs.sizes());
    UNIEP_CHECK(offs.scalar_type() == at::kInt, "offs must be int32, got ", offs.scalar_type());
    UNIEP_CHECK(tile_m >= 1 && tile_m <= (1 << 20), "tile_m must be in [1, 2^20], got ", tile_m);
    const at::Tensor o = offs.contiguous();
    const std::vector<int32_t> base =
        gate_tile_base(o.data_ptr<int32_t>(), o.size(0), rows, tile_m);
    at::Tensor out = at::empty({static_cast<int64_t>(base.size())}, o.options());
    std::copy(base.begin(), base.end(), out.data_ptr<int32_t>());
    return out;
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CPU, m) {
  m.impl("gate_tile_base", &uniep::torch_glue::gate_tile_base_cpu);
  m.impl("moe_forward", &uniep::torch_glue::moe_forward_cpu);
  m.impl("moe_backward", &uniep::torch_glue::moe_backward_cpu);
  m.impl("routing_layout", &uniep::torch_glue::routing_layout_cpu);
}
