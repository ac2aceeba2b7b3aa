// torch.ops.uniep.expert_rows on CPU, and the checks its CUDA implementation shares.
#include "torch/dispatch/expert_rows.hpp"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "uniep/plan.hpp"
#include "uniep/shape.hpp"
#include "uniep/status.hpp"

namespace uniep::torch_glue {
namespace {

// The first index where `bad` holds (flattened), or -1; on the tensors' device.
at::Tensor first_true(const at::Tensor& bad) {
  const at::Tensor flat = bad.flatten();
  return at::where(flat.any(), flat.to(at::kInt).argmax(),
                   at::full({}, -1, flat.options().dtype(at::kLong)));
}

}  // namespace

ExpertRowsDims check_expert_rows_args(const at::Tensor& recv_src, const at::Tensor& recv_topk_idx,
                                      const at::Tensor& recv_from_rank, int64_t rank,
                                      int64_t num_experts, int64_t max_tokens, Executor executor) {
  const std::pair<const at::Tensor*, const char*> tensors[] = {{&recv_src, "recv_src"},
                                                               {&recv_topk_idx, "recv_topk_idx"},
                                                               {&recv_from_rank, "recv_from_rank"}};
  for (const auto& [t, name] : tensors) {
    UNIEP_CHECK(t->scalar_type() == at::kLong, name, " must be int64, got ", t->scalar_type());
    check_executor_device(*t, name, executor);
    UNIEP_CHECK(t->device() == recv_src.device(), name, " must be on recv_src's device ",
                recv_src.device(), ", got ", t->device());
  }
  UNIEP_CHECK(recv_src.dim() == 1, "recv_src must be 1-D [N], got ", recv_src.dim(), "-D");
  UNIEP_CHECK(recv_topk_idx.dim() == 2 && recv_topk_idx.size(0) == recv_src.size(0),
              "recv_topk_idx must be [N, K] with N = ", recv_src.size(0),
              " (recv_src's length), got ", recv_topk_idx.sizes());
  UNIEP_CHECK(recv_topk_idx.size(1) >= 1, "recv_topk_idx must have K >= 1 columns, got ",
              recv_topk_idx.size(1));
  UNIEP_CHECK(recv_from_rank.dim() == 1 && recv_from_rank.size(0) >= 1,
              "recv_from_rank must be 1-D [world_size] with world_size >= 1, got ",
              recv_from_rank.sizes());
  const int64_t W = recv_from_rank.size(0);
  UNIEP_CHECK(rank >= 0 && rank < W, "rank must be in [0, ", W,
              ") (recv_from_rank's length is the world size), got ", rank);
  UNIEP_CHECK(num_experts >= 1 && num_experts % W == 0, "num_experts (", num_experts,
              ") must be a positive multiple of the world size (", W, ")");
  UNIEP_CHECK(num_experts <= kMaxExperts, "num_experts must be <= ", kMaxExperts,
              " (2**20, uniep::kMaxExperts), got ", num_experts);
  UNIEP_CHECK(max_tokens >= 1, "max_tokens must be >= 1, got ", max_tokens);
  const int64_t El = num_experts / W;
  return {W, El, rank * El, recv_topk_idx.size(1), recv_src.size(0)};
}

void check_expert_rows_values(const at::Tensor& recv_src, const at::Tensor& recv_topk_idx,
                              const at::Tensor& recv_from_rank, int64_t num_experts,
                              int64_t max_tokens, const ExpertRowsDims& d) {
  // Every check is reduced on the tensors' device first, so a CUDA tensor costs one copy.
  std::vector<at::Tensor> parts = {(recv_from_rank < 0).any().to(at::kLong), recv_from_rank.sum()};
  if (d.slots > 0) {
    const at::Tensor ids = recv_topk_idx;
    const at::Tensor local = (ids >= d.first_expert) & (ids < d.first_expert + d.experts_per_rank);
    const at::Tensor bad_src = first_true((recv_src < 0) | (recv_src >= max_tokens));
    const at::Tensor bad_id = first_true((ids < -1) | (ids >= num_experts));
    parts.insert(parts.end(),
                 {bad_src, recv_src.flatten().index({bad_src.clamp_min(0)}), bad_id,
                  ids.flatten().index({bad_id.clamp_min(0)}), first_true(~local.any(1))});
  }
  const at::Tensor got = at::stack(parts).cpu();
  const int64_t* v = got.data_ptr<int64_t>();
  UNIEP_CHECK(v[0] == 0, "recv_from_rank must hold no negative count");
  UNIEP_CHECK(v[1] == d.slots, "recv_from_rank must sum to the number of slots N = ", d.slots,
              " (recv_src's length), got ", v[1]);
  if (d.slots == 0) return;
  UNIEP_CHECK(v[2] < 0, "recv_src[", v[2], "] = ", v[3], " is outside [0, ", max_tokens,
              ") (max_tokens)");
  UNIEP_CHECK(v[4] < 0, "recv_topk_idx[", v[4] / d.top_k, ", ", v[4] % d.top_k, "] = ", v[5],
              " is outside [-1, ", num_experts, ")");
  UNIEP_CHECK(v[6] < 0, "receive slot ", v[6], " names no expert of this rank (recv_topk_idx[",
              v[6], "] holds none of experts [", d.first_expert, ", ",
              d.first_expert + d.experts_per_rank,
              ")); a dispatch only sends a rank tokens for its "
              "experts");
}

at::Tensor expert_rows_input_flaw(const at::Tensor& recv_src, const at::Tensor& recv_topk_idx,
                                  const at::Tensor& recv_from_rank, int64_t num_experts,
                                  int64_t max_tokens, const ExpertRowsDims& d) {
  at::Tensor flaw = (recv_from_rank < 0).any() | (recv_from_rank.sum() != d.slots);
  if (d.slots > 0) {
    const at::Tensor& ids = recv_topk_idx;
    const at::Tensor local = (ids >= d.first_expert) & (ids < d.first_expert + d.experts_per_rank);
    flaw = flaw | ((recv_src < 0) | (recv_src >= max_tokens)).any() |
           ((ids < -1) | (ids >= num_experts)).any() | (~local.any(1)).any();
  }
  return flaw.to(at::kLong);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_rows_cpu(const at::Tensor& recv_src,
                                                               const at::Tensor& recv_topk_idx,
                                                               const at::Tensor& recv_from_rank,
                                                               int64_t rank, int64_t num_experts,
                                                               int64_t max_tokens) {
  return translate_errors([&] {
    const ExpertRowsDims d = check_expert_rows_args(recv_src, recv_topk_idx, recv_from_rank, rank,
                                                    num_experts, max_tokens, Executor::kCpu);
    check_expert_rows_values(recv_src, recv_topk_idx, recv_from_rank, num_experts, max_tokens, d);
    const at::Tensor src = recv_src.contiguous(), ids = recv_topk_idx.contiguous();
    const at::Tensor from = recv_from_rank.contiguous();
    MoeShape shape;
    shape.tokens = max_tokens;
    shape.hidden = 1;
    shape.ffn_hidden = 1;
    shape.top_k = d.top_k;
    shape.num_experts = num_experts;
    shape.world_size = d.world_size;
    shape.rank = rank;
    SlotPlan slots;
    slots.world_size = d.world_size;
    slots.rank = rank;
    slots.recv_offsets.assign(d.world_size + 1, 0);
    for (int64_t s = 0; s < d.world_size; ++s)
      slots.recv_offsets[s + 1] = slots.recv_offsets[s] + from.data_ptr<int64_t>()[s];
    // What the senders would have announced: (source, expert) pairs of the metadata itself.
    std::vector<int64_t> expert_counts(d.world_size * num_experts, 0);
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t s = 0, slot = 0; s < d.world_size; ++s)
      for (; slot < slots.recv_offsets[s + 1]; ++slot)
        for (int64_t k = 0; k < d.top_k; ++k)
          if (idp[slot * d.top_k + k] >= 0)
            ++expert_counts[s * num_experts + idp[slot * d.top_k + k]];
    const ExpertPlan plan =
        plan_experts(slots, src.data_ptr<int64_t>(), idp, expert_counts.data(), shape);
    const int64_t R = plan.num_rows(), K = d.top_k;
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    at::Tensor row_slot = at::empty({R}, i64), row_target = at::empty({R}, i64);
    at::Tensor per_expert = at::empty({d.experts_per_rank}, i64);
    std::copy(plan.row_slot.begin(), plan.row_slot.end(), row_slot.data_ptr<int64_t>());
    int64_t* target = row_target.data_ptr<int64_t>();
    for (int64_t r = 0; r < R; ++r)
      target[r] = plan.row_src_rank[r] * max_tokens * K + plan.row_combine_slot[r];
    for (int64_t e = 0; e < d.experts_per_rank; ++e)
      per_expert.data_ptr<int64_t>()[e] = plan.row_offsets[e + 1] - plan.row_offsets[e];
    return std::make_tuple(row_slot, row_target, per_expert);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CPU, m) {
  m.impl("expert_rows", &uniep::torch_glue::expert_rows_cpu);
}
