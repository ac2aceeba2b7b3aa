#include "torch/common/call_checks.hpp"

#include <optional>

#include "uniep/status.hpp"

namespace uniep::torch_glue {

namespace {
std::string describe_overlap(int64_t v) {
  return overlap_mode_name(static_cast<OverlapMode>(v));
}
std::string describe_dispatch(int64_t v) {
  return dispatch_precision_name(static_cast<DispatchPrecision>(v));
}
std::string describe_combine(int64_t v) {
  return combine_reduction_name(static_cast<CombineReduction>(v));
}
std::string describe_gemm(int64_t v) {
  return gemm_engine_name(static_cast<GemmEngine>(v));
}
std::string describe_fp8_experts(int64_t v) {
  return v != 0 ? "fp8" : "bf16";
}
}  // namespace

CallSignature check_and_agree(const Group& group, CallKind kind, c10::Device device,
                              const std::function<CallSignature()>& check) {
  if (!group.pg || group.world_size == 1) return check();
  CallSignature signature{kind, {}};
  std::optional<Error> local_error;
  try {
    signature = check();
  } catch (const Error& e) {
    local_error = e;
  }
  ProcessGroupTransport transport(group.pg, call_kind_name(kind), device);
  try {
    agree_on_call(signature, local_error ? &*local_error : nullptr, transport);
  } catch (const Error& e) {
    // The agreement names ranks of the group; on a sub-group, say which global ranks they are
    // (where the message names one: this rank's own error names none).
    throw with_group_ranks(e, group.pg->getGroupName());
  }
  return signature;
}

std::vector<int64_t> share_on_group(const Group& group, c10::Device device,
                                    const CallSignature& signature) {
  if (!group.pg || group.world_size == 1) {
    std::vector<int64_t> values;
    for (const CallField& f : signature.fields) values.push_back(f.value);
    return values;
  }
  ProcessGroupTransport transport(group.pg, call_kind_name(signature.kind), device);
  return share_call(signature, nullptr, transport);
}

CallSignature moe_signature(CallKind kind, DType dtype, DType weight_dtype, const MoeShape& shape,
                            const TuningParams& tuning) {
  return {kind,
          {{"x dtype", static_cast<int64_t>(dtype), describe_dtype},
           {"topk_weights dtype", static_cast<int64_t>(weight_dtype), describe_dtype},
           {"hidden (x.size(1))", shape.hidden},
           {"ffn_hidden (w2.size(1))", shape.ffn_hidden},
           {"num_experts (w1.size(0) x world size)", shape.num_experts},
           {"top_k (topk_idx.size(1))", shape.top_k},
           {"ranks per node (uniep.init's ranks_per_node, or LOCAL_WORLD_SIZE under torchrun)",
            shape.node_size()},
           // Every key of the tuning: the precision and the combine change what crosses the
           // wire, and the rest must match for the schedules to pair up.
           {"tuning sms (communication)", tuning.comm_sms},
           {"tuning sms (total)", tuning.total_sms},
           {"tuning token_tile", tuning.token_tile},
           {"tuning tile_m", tuning.tile_m},
           {"tuning tile_n", tuning.tile_n},
           {"tuning tile_k", tuning.tile_k},
           {"tuning stages", tuning.stages},
           {"tuning cluster", tuning.cluster},
           {"tuning skip_rounds", tuning.skip_rounds},
           {"tuning overlap", static_cast<int64_t>(tuning.overlap), describe_overlap},
           {"tuning dispatch", static_cast<int64_t>(tuning.dispatch), describe_dispatch},
           {"tuning combine", static_cast<int64_t>(tuning.combine), describe_combine},
           {"tuning gemm", static_cast<int64_t>(tuning.gemm), describe_gemm},
           // Resolved: experts=auto and experts=fp8 beside dispatch=fp8 are one numerics.
           {"tuning experts (fp8 GEMMs)", tuning.fp8_experts() ? 1 : 0, describe_fp8_experts}}};
}

}  // namespace uniep::torch_glue
