// The two-level plan of a group that spans nodes (docs/multinode.md): which of a rank's tokens
// cross to each node on the rail, what a relay forwards over NVLink to the ranks of its node, and
// where a relayed row lands. The receive slots, the experts' rows and the combine targets are the
// flat plan's (plan.hpp): only the way rows travel changes, so with combine=per_k the output bits
// are the flat path's for any node size.
//
// Words: node n holds ranks [n * L, (n + 1) * L) (MoeShape::node_size). The rail peer of rank
// (m, l) on node n is (n, l). A token of rank s = (m, l) bound for node n travels once to the
// relay (n, l) (itself when n == m), which forwards it to each rank of node n holding one of its
// experts. Every row of source s therefore reaches node n through the one relay (n, local(s)).
#pragma once

#include <cstdint>
#include <vector>

#include "uniep/plan.hpp"
#include "uniep/shape.hpp"

namespace uniep {

struct NodePlan {
  int64_t num_nodes = 1;
  int64_t node_size = 1;
  // Source side: this rank's tokens bound for each node (one expert there or more), ascending,
  // grouped by node; its own node included (it relays those itself).
  std::vector<int64_t> send_offsets;  // [N + 1]
  std::vector<int64_t> send_tokens;
  // Relay side: the rows this rank forwards into its own node, grouped by source node m
  // ascending: the tokens of its rail peer (m, local) bound here, each group in token order.
  std::vector<int64_t> relay_offsets;  // [N + 1]

  int64_t num_send() const { return send_offsets.back(); }
  int64_t num_relayed() const { return relay_offsets.back(); }
  // The source rank of relay group m.
  int64_t relay_source(int64_t m, int64_t rank) const { return m * node_size + rank % node_size; }
};

// The tokens of each node a routing sends to: tokens_per_node[n] counts the tokens with at least
// one expert on node n. [N] from layout.token_in_rank.
std::vector<int64_t> tokens_per_node(const RoutingLayout& layout, const MoeShape& shape);

// node_counts: [W][N] row-major, tokens_per_node of every rank (all-gathered). Checks this rank's
// row against its own layout.
NodePlan plan_nodes(const RoutingLayout& layout, const int64_t* node_counts, const MoeShape& shape);

// What a relay forwards to each rank of its node: relayed row indices (NodePlan's relay order)
// grouped by destination local index, each group in (source rank, source token) order: the
// order the destination's receive slots hold them. relayed_topk [num_relayed][K]: the routing
// that arrived with each row. rank_counts [W][W] is what every source announced; a relay whose
// rows route another number of tokens to a rank throws kInternal (a row is never dropped or
// invented silently).
struct RelayPlan {
  std::vector<int64_t> offsets;  // [L + 1]
  std::vector<int64_t> rows;     // relayed row index, by destination
};
RelayPlan plan_relay(const NodePlan& nodes, const int64_t* relayed_topk, const int64_t* rank_counts,
                     const MoeShape& shape);

// The receive slot of each row a rank gets from its node's relays, in arrival order: relay local
// index l ascending, then source node m ascending (source (m, l)), then the source's tokens in
// order. [num_recv] from the announced counts alone.
std::vector<int64_t> relayed_slot_order(const int64_t* rank_counts, const MoeShape& shape);

}  // namespace uniep
