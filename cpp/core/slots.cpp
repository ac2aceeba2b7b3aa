#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace uniep {

SlotPlan plan_slots(const RoutingLayout& layout, const int64_t* rank_counts,
                    const MoeShape& shape) {
  const int64_t W = shape.world_size, me = shape.rank, T = shape.tokens;
  UNIEP_CHECK(static_cast<int64_t>(layout.tokens_per_rank.size()) == W,
              "layout.tokens_per_rank must have world_size entries");
  for (int64_t d = 0; d < W; ++d) {
    UNIEP_CHECK_CODE(rank_counts[me * W + d] == layout.tokens_per_rank[d], StatusCode::kInternal,
                     "exchanged rank counts disagree with the local layout for destination ", d);
  }
  SlotPlan plan;
  plan.world_size = W;
  plan.rank = me;

  // Slots on destination d: sources in rank order, each source's tokens in token order. The
  // base of my range there is the exclusive prefix over lower source ranks.
  plan.send_offsets.assign(W + 1, 0);
  for (int64_t d = 0; d < W; ++d)
    plan.send_offsets[d + 1] = plan.send_offsets[d] + layout.tokens_per_rank[d];
  plan.send_tokens.resize(plan.send_offsets[W]);
  plan.send_slots.resize(plan.send_offsets[W]);
  std::vector<int64_t> cursor(plan.send_offsets.begin(), plan.send_offsets.end() - 1);
  std::vector<int64_t> base(W, 0);
  for (int64_t d = 0; d < W; ++d) {
    for (int64_t s = 0; s < me; ++s) base[d] += rank_counts[s * W + d];
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < W; ++d) {
      if (!layout.token_in_rank[t * W + d]) continue;
      const int64_t i = cursor[d]++;
      plan.send_tokens[i] = t;
      plan.send_slots[i] = base[d] + (i - plan.send_offsets[d]);
    }
  }

  plan.recv_offsets.assign(W + 1, 0);
  for (int64_t s = 0; s < W; ++s)
    plan.recv_offsets[s + 1] = plan.recv_offsets[s] + rank_counts[s * W + me];
  return plan;
}

}  // namespace uniep
