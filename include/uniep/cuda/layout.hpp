// Routing layout on the GPU: the counts every rank computes from its own routing before the
// dispatch (what DeepEP calls the dispatch layout). Same definition and bits as the CPU
// uniep::compute_layout in uniep/plan.hpp.
//
// All pointers are device pointers; arrays are contiguous, row-major. Functions return a Status
// instead of throwing so that a C++ server can call them without exception handling across its
// own CUDA code; kInvalidArgument messages name the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "uniep/status.hpp"

namespace uniep::cuda {

// The argument checks routing_layout_async starts with (same messages as the CPU planner), for
// callers that allocate the outputs first and want bad sizes reported before that.
Status validate_routing_layout(int64_t tokens, int64_t top_k, int64_t num_experts,
                               int64_t world_size);

// Value of the error word when every expert id was in [-1, E).
inline constexpr unsigned long long kNoLayoutError = ~0ull;

// Launches the layout kernel on `stream`; never synchronizes, so it can be captured in a CUDA
// graph.
//
//   topk_idx           [tokens, top_k] int64, global expert ids; -1 marks an unused slot
//   tokens_per_rank    [world_size] int64 out: tokens with at least one expert on rank r (a token
//                      counts once per rank); rank r owns experts [r*E/W, (r+1)*E/W)
//   tokens_per_expert  [num_experts] int64 out: (token, k) pairs routed to each expert
//   token_in_rank      [tokens, world_size] bool out
//   error_word         one device uint64, or nullptr. The kernel stores there the smallest
//                      row-major index t*top_k+k of an expert id outside [-1, num_experts)
//                      (kNoLayoutError if none; this function resets it first); pass it to
//                      check_routing_layout. With nullptr a bad id traps the kernel instead:
//                      the CUDA context is lost, but no routing is ever dropped silently.
//
// Counts are integer sums, so they are exact and identical run to run whatever the block order.
// tokens == 0 is valid (counts become zero; only their reset is launched).
Status routing_layout_async(const int64_t* topk_idx, int64_t tokens, int64_t top_k,
                            int64_t num_experts, int64_t world_size, int64_t* tokens_per_rank,
                            int64_t* tokens_per_expert, bool* token_in_rank,
                            unsigned long long* error_word, cudaStream_t stream);

// Synchronizes `stream` to read `error_word` (written by routing_layout_async on that stream) and
// returns kInvalidArgument "topk_idx contains expert id X at [t, k], outside [-1, E)" for the first
// bad id in row-major order, exactly as the CPU planner reports it.
Status check_routing_layout(const int64_t* topk_idx, int64_t top_k, int64_t num_experts,
                            const unsigned long long* error_word, cudaStream_t stream);

// routing_layout_async + check_routing_layout with a stream-ordered scratch word: synchronizes
// `stream`, so it cannot be captured in a CUDA graph (use the two calls above for that).
Status routing_layout(const int64_t* topk_idx, int64_t tokens, int64_t top_k, int64_t num_experts,
                      int64_t world_size, int64_t* tokens_per_rank, int64_t* tokens_per_expert,
                      bool* token_in_rank, cudaStream_t stream);

}  // namespace uniep::cuda
