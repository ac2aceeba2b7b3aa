// The problem an MoE layer solves on one rank, as plain integers.
#pragma once

#include <cstdint>
#include <string>

namespace uniep {

// Bounds MoeShape::validate enforces, so that a nonsense count is a named ValueError rather than a
// failed allocation: the planner sizes arrays by them ([E] and [W] counts, [T, W] flags, a
// [W, W + E] count exchange). 2**20 experts is the largest MoE published (PEER's 1024 x 1024);
// an expert-parallel group of 2**16 ranks is far beyond any machine. Within the bounds, memory is
// the caller's to provide.
inline constexpr int64_t kMaxExperts = int64_t{1} << 20;
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 16;

struct MoeShape {
  int64_t tokens = 0;       // T: tokens on this rank (may be 0)
  int64_t hidden = 0;       // H
  int64_t ffn_hidden = 0;   // I: per-expert intermediate size (w1 is [H, 2I])
  int64_t num_experts = 0;  // E: global expert count, split evenly across ranks
  int64_t top_k = 0;        // K
  int64_t world_size = 1;   // W
  int64_t rank = 0;

  int64_t experts_per_rank() const { return num_experts / world_size; }
  int64_t rank_of_expert(int64_t expert) const { return expert / experts_per_rank(); }
  int64_t first_local_expert() const { return rank * experts_per_rank(); }

  // Throws uniep::Error naming the offending field.
  void validate() const;
  std::string to_string() const;
};

}  // namespace uniep
