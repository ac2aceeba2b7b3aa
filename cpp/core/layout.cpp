#include "uniep/plan.hpp"
#include "uniep/shape.hpp"
#include "uniep/status.hpp"

namespace uniep {

RoutingLayout compute_layout(const int64_t* topk_idx, const MoeShape& shape) {
  shape.validate();
  const int64_t T = shape.tokens, K = shape.top_k, W = shape.world_size, E = shape.num_experts;
  UNIEP_CHECK(T == 0 || topk_idx != nullptr, "topk_idx must not be null");
  RoutingLayout layout;
  layout.tokens_per_rank.assign(W, 0);
  layout.tokens_per_expert.assign(E, 0);
  layout.token_in_rank.assign(T * W, 0);
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* in_rank = layout.token_in_rank.data() + t * W;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = topk_idx[t * K + k];
      if (e == -1) continue;
      UNIEP_CHECK(e >= 0 && e < E, bad_expert_id_message(e, t, k, E));
      ++layout.tokens_per_expert[e];
      in_rank[shape.rank_of_expert(e)] = 1;
    }
    for (int64_t r = 0; r < W; ++r) layout.tokens_per_rank[r] += in_rank[r];
  }
  return layout;
}

}  // namespace uniep
