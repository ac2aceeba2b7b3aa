#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace uniep {

SlotPlan plan_slots(const RoutingLayout& layout, const int64_t* rank_counts,
                    const MoeShape& shape) {
  shape.validate();
  const int64_t W = shape.world_size, me = shape.rank, T = shape.tokens;
  UNIEP_CHECK(static_cast<int64_t>(layout.tokens_per_rank.size()) == W,
              "layout.tokens_per_rank must have world_size (", W, ") entries, got ",
              layout.tokens_per_rank.size());
  UNIEP_CHECK(static_cast<int64_t>(layout.token_in_rank.size()) == T * W,
              "layout.token_in_rank must have tokens * world_size (", T * W, ") entries, got ",
              layout.token_in_rank.size());
  UNIEP_CHECK(rank_counts != nullptr, "rank_counts must not be null");
  // Counts of other ranks come off the wire: a negative or absurd one would make negative slots
  // or sums that wrap. No rank sends a destination more than kMaxTokens tokens. Checked where
  // read (rows up to mine and my column), so the check costs no more than the plan.
  auto count = [&](int64_t s, int64_t d) {
    const int64_t c = rank_counts[s * W + d];
    UNIEP_CHECK(c >= 0 && c <= kMaxTokens, "rank_counts[", s, "][", d, "] (tokens rank ", s,
                " sends rank ", d, ") must be in [0, 2**32], got ", c);
    return c;
  };
  for (int64_t d = 0; d < W; ++d) {
    UNIEP_CHECK(layout.tokens_per_rank[d] >= 0 && layout.tokens_per_rank[d] <= T,
                "layout.tokens_per_rank[", d, "] must be in [0, tokens = ", T, "], got ",
                layout.tokens_per_rank[d]);
    UNIEP_CHECK_CODE(count(me, d) == layout.tokens_per_rank[d], StatusCode::kInternal,
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
    for (int64_t s = 0; s < me; ++s) base[d] += count(s, d);
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < W; ++d) {
      if (!layout.token_in_rank[t * W + d]) continue;
      const int64_t i = cursor[d]++;
      UNIEP_CHECK(i < plan.send_offsets[d + 1], "layout.token_in_rank marks more tokens for rank ",
                  d, " than layout.tokens_per_rank[", d, "] = ", layout.tokens_per_rank[d]);
      plan.send_tokens[i] = t;
      plan.send_slots[i] = base[d] + (i - plan.send_offsets[d]);
    }
  }

  for (int64_t d = 0; d < W; ++d) {
    UNIEP_CHECK(cursor[d] == plan.send_offsets[d + 1], "layout.token_in_rank marks fewer tokens ",
                "for rank ", d, " than layout.tokens_per_rank[", d,
                "] = ", layout.tokens_per_rank[d]);
  }
  plan.recv_offsets.assign(W + 1, 0);
  for (int64_t s = 0; s < W; ++s) plan.recv_offsets[s + 1] = plan.recv_offsets[s] + count(s, me);
  return plan;
}

}  // namespace uniep
