#include "uniep/node_plan.hpp"

#include "uniep/status.hpp"

namespace uniep {
namespace {

// Whether a token (its row of token_in_rank) has an expert on one of node n's L ranks.
bool bound_for_node(const uint8_t* in_rank, int64_t n, int64_t L) {
  for (int64_t l = 0; l < L; ++l)
    if (in_rank[n * L + l]) return true;
  return false;
}

}  // namespace

std::vector<int64_t> tokens_per_node(const RoutingLayout& layout, const MoeShape& shape) {
  const int64_t W = shape.world_size, L = shape.node_size(), N = shape.num_nodes();
  const int64_t T = shape.tokens;
  UNIEP_CHECK_CODE(static_cast<int64_t>(layout.token_in_rank.size()) == T * W,
                   StatusCode::kInternal, "layout.token_in_rank must have tokens x world entries");
  std::vector<int64_t> counts(N, 0);
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* in_rank = &layout.token_in_rank[t * W];
    for (int64_t n = 0; n < N; ++n) counts[n] += bound_for_node(in_rank, n, L);
  }
  return counts;
}

NodePlan plan_nodes(const RoutingLayout& layout, const int64_t* node_counts,
                    const MoeShape& shape) {
  const int64_t W = shape.world_size, L = shape.node_size(), N = shape.num_nodes();
  const int64_t me = shape.rank, T = shape.tokens, home = shape.node_of(me);
  NodePlan plan;
  plan.num_nodes = N;
  plan.node_size = L;
  plan.send_offsets.assign(N + 1, 0);
  for (int64_t n = 0; n < N; ++n)
    plan.send_offsets[n + 1] = plan.send_offsets[n] + node_counts[me * N + n];
  plan.send_tokens.resize(plan.send_offsets[N]);
  std::vector<int64_t> cursor(plan.send_offsets.begin(), plan.send_offsets.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* in_rank = &layout.token_in_rank[t * W];
    for (int64_t n = 0; n < N; ++n) {
      if (!bound_for_node(in_rank, n, L)) continue;
      UNIEP_CHECK_CODE(cursor[n] < plan.send_offsets[n + 1], StatusCode::kInternal,
                       "exchanged node counts disagree with the local layout for node ", n);
      plan.send_tokens[cursor[n]++] = t;
    }
  }
  for (int64_t n = 0; n < N; ++n) {
    UNIEP_CHECK_CODE(cursor[n] == plan.send_offsets[n + 1], StatusCode::kInternal,
                     "exchanged node counts disagree with the local layout for node ", n);
  }
  plan.relay_offsets.assign(N + 1, 0);
  for (int64_t m = 0; m < N; ++m) {
    const int64_t source = plan.relay_source(m, me);
    plan.relay_offsets[m + 1] = plan.relay_offsets[m] + node_counts[source * N + home];
  }
  return plan;
}

RelayPlan plan_relay(const NodePlan& nodes, const int64_t* relayed_topk, const int64_t* rank_counts,
                     const MoeShape& shape) {
  const int64_t W = shape.world_size, L = shape.node_size(), K = shape.top_k;
  const int64_t E = shape.num_experts, me = shape.rank, home = shape.node_of(me);
  RelayPlan plan;
  // Counts first (sizes), then the rows: each destination's rows stay in relay order, which is
  // source-rank order (source node ascending, one source per node) and token order within it.
  std::vector<std::vector<int64_t>> by_dest(L);
  std::vector<int64_t> seen(L, 0);
  std::vector<uint8_t> hit(L);
  for (int64_t m = 0; m < nodes.num_nodes; ++m) {
    const int64_t source = nodes.relay_source(m, me);
    std::fill(seen.begin(), seen.end(), 0);
    for (int64_t i = nodes.relay_offsets[m]; i < nodes.relay_offsets[m + 1]; ++i) {
      std::fill(hit.begin(), hit.end(), 0);
      bool any = false;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t e = relayed_topk[i * K + k];
        if (e < 0) continue;
        UNIEP_CHECK_CODE(e < E, StatusCode::kInternal, "relay on rank ", me, ": row ", i,
                         " from rank ", source, " names expert ", e, ", outside [0, ", E, ")");
        const int64_t d = shape.rank_of_expert(e);
        if (shape.node_of(d) != home) continue;
        any = true;
        hit[shape.local_of(d)] = 1;
      }
      UNIEP_CHECK_CODE(any, StatusCode::kInternal, "relay on rank ", me, ": row ", i, " from rank ",
                       source, " has no expert on node ", home);
      for (int64_t l = 0; l < L; ++l) {
        if (!hit[l]) continue;
        by_dest[l].push_back(i);
        ++seen[l];
      }
    }
    for (int64_t l = 0; l < L; ++l) {
      const int64_t d = home * L + l;
      UNIEP_CHECK_CODE(seen[l] == rank_counts[source * W + d], StatusCode::kInternal,
                       "relay on rank ", me, ": rank ", source, " announced ",
                       rank_counts[source * W + d], " tokens for rank ", d,
                       " but the rows it relayed route ", seen[l], " there");
    }
  }
  plan.offsets.assign(L + 1, 0);
  for (int64_t l = 0; l < L; ++l)
    plan.offsets[l + 1] = plan.offsets[l] + static_cast<int64_t>(by_dest[l].size());
  plan.rows.reserve(plan.offsets[L]);
  for (int64_t l = 0; l < L; ++l)
    plan.rows.insert(plan.rows.end(), by_dest[l].begin(), by_dest[l].end());
  return plan;
}

std::vector<int64_t> relayed_slot_order(const int64_t* rank_counts, const MoeShape& shape) {
  const int64_t W = shape.world_size, L = shape.node_size(), N = shape.num_nodes();
  const int64_t me = shape.rank;
  std::vector<int64_t> base(W + 1, 0);
  for (int64_t s = 0; s < W; ++s) base[s + 1] = base[s] + rank_counts[s * W + me];
  std::vector<int64_t> order;
  order.reserve(base[W]);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t m = 0; m < N; ++m) {
      const int64_t s = m * L + l;
      for (int64_t slot = base[s]; slot < base[s + 1]; ++slot) order.push_back(slot);
    }
  }
  return order;
}

}  // namespace uniep
