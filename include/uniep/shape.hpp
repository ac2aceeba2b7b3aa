// The problem an MoE layer solves on one rank, as plain integers.
#pragma once

#include <cstdint>
#include <string>

#include "uniep/status.hpp"

namespace uniep {

// What every path says of a topk_idx entry [token, k] holding an expert id outside [-1,
// num_experts) (-1 alone marks an unused entry): the CPU planner, the dispatch's layout check,
// the low-latency dispatch and the world-1 layer's plan, so that one bad id reads the same on each.
inline std::string bad_expert_id_message(int64_t id, int64_t token, int64_t k,
                                         int64_t num_experts) {
  return detail::str_cat("topk_idx contains expert id ", id, " at [", token, ", ", k,
                         "], outside [-1, ", num_experts, ")");
}

// Bounds MoeShape::validate enforces, so that a nonsense count is a named ValueError rather than a
// failed allocation or a size that wraps: the planner sizes arrays by them ([E] and [W] counts,
// [T, W] flags, [T * K] entries, a [W, W + E] count exchange). 2**20 experts is the largest MoE
// published (PEER's 1024 x 1024); an expert-parallel group of 2**16 ranks is far beyond any
// machine; 2**32 tokens on one rank is far beyond any batch (its hidden states alone would be
// 2**32 x H elements). top_k takes the experts' bound rather than num_experts itself: a token's
// entries may repeat an expert or be -1. Within the bounds, memory is the caller's to provide.
inline constexpr int64_t kMaxExperts = int64_t{1} << 20;
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 16;
inline constexpr int64_t kMaxTokens = int64_t{1} << 32;
inline constexpr int64_t kMaxTopK = kMaxExperts;
// The products the planner sizes by stay far inside int64 at the bounds.
static_assert(kMaxTokens * kMaxWorldSize <= (int64_t{1} << 48) &&
                  kMaxTokens * kMaxTopK <= (int64_t{1} << 52),
              "[T, W] flags and [T, K] entries must not overflow int64 at the bounds");

struct MoeShape {
  int64_t tokens = 0;       // T: tokens on this rank (may be 0)
  int64_t hidden = 0;       // H
  int64_t ffn_hidden = 0;   // I: per-expert intermediate size (w1 is [H, 2I])
  int64_t num_experts = 0;  // E: global expert count, split evenly across ranks
  int64_t top_k = 0;        // K
  int64_t world_size = 1;   // W
  int64_t rank = 0;
  // L: ranks per node (an NVLink domain). 0 or W: one node. Below W the ranks form W / L nodes
  // of L consecutive ranks, and tokens cross between nodes once per (token, node) on the rail
  // (docs/multinode.md). Output bits depend on it only through combine=node_partials.
  int64_t ranks_per_node = 0;

  int64_t experts_per_rank() const { return num_experts / world_size; }
  int64_t rank_of_expert(int64_t expert) const { return expert / experts_per_rank(); }
  int64_t first_local_expert() const { return rank * experts_per_rank(); }

  // The topology: node n holds ranks [n * L, (n + 1) * L); rank r is local index r % L there.
  int64_t node_size() const { return ranks_per_node > 0 ? ranks_per_node : world_size; }
  int64_t num_nodes() const { return world_size / node_size(); }
  int64_t node_of(int64_t r) const { return r / node_size(); }
  int64_t local_of(int64_t r) const { return r % node_size(); }
  bool spans_nodes() const { return node_size() < world_size; }

  // Throws uniep::Error naming the offending field.
  void validate() const;
  std::string to_string() const;
};

}  // namespace uniep
