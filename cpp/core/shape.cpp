#include "uniep/shape.hpp"

#include "uniep/status.hpp"

namespace uniep {

void MoeShape::validate() const {
  UNIEP_CHECK(tokens >= 0, "tokens must be >= 0, got ", tokens);
  UNIEP_CHECK(tokens <= kMaxTokens, "tokens must be <= ", kMaxTokens,
              " (2**32, uniep::kMaxTokens), got ", tokens);
  UNIEP_CHECK(hidden > 0, "hidden must be > 0, got ", hidden);
  UNIEP_CHECK(ffn_hidden > 0, "ffn_hidden must be > 0, got ", ffn_hidden);
  UNIEP_CHECK(world_size > 0, "world_size must be > 0, got ", world_size);
  UNIEP_CHECK(world_size <= kMaxWorldSize, "world_size must be <= ", kMaxWorldSize,
              " (2**16, uniep::kMaxWorldSize), got ", world_size);
  UNIEP_CHECK(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ", rank);
  UNIEP_CHECK(num_experts > 0, "num_experts must be > 0, got ", num_experts);
  UNIEP_CHECK(num_experts <= kMaxExperts, "num_experts must be <= ", kMaxExperts,
              " (2**20, uniep::kMaxExperts), got ", num_experts);
  UNIEP_CHECK(num_experts % world_size == 0, "num_experts (", num_experts,
              ") must be divisible by the world size (", world_size, ")");
  UNIEP_CHECK(top_k > 0, "top_k must be > 0, got ", top_k);
  UNIEP_CHECK(top_k <= kMaxTopK, "top_k must be <= ", kMaxTopK, " (2**20, uniep::kMaxTopK), got ",
              top_k);
  UNIEP_CHECK(ranks_per_node >= 0 && ranks_per_node <= world_size,
              "ranks_per_node must be in [1, world size ", world_size, "] (0: one node), got ",
              ranks_per_node);
  UNIEP_CHECK(world_size % node_size() == 0, "ranks_per_node (", ranks_per_node,
              ") must divide the world size (", world_size,
              "): every node holds as many ranks (ranks_per_node is uniep.init's, or "
              "LOCAL_WORLD_SIZE under torchrun)");
}

std::string MoeShape::to_string() const {
  const std::string nodes =
      spans_nodes() ? detail::str_cat(", ranks_per_node=", ranks_per_node) : std::string();
  return detail::str_cat("MoeShape(tokens=", tokens, ", hidden=", hidden,
                         ", ffn_hidden=", ffn_hidden, ", num_experts=", num_experts,
                         ", top_k=", top_k, ", world_size=", world_size, ", rank=", rank, nodes,
                         ")");
}

}  // namespace uniep
