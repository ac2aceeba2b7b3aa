// The count exchange of the fused forward across ranks (include/uniep/cuda/fused_ep.hpp), with
// plain pointers to the peers' symmetric buffers (nvshmem_ptr mappings): no NVSHMEM device call,
// so it lives with the GEMMs' non-relocatable code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/tile_gate.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

struct FusedExchangeArgs {
  const int64_t* topk_idx = nullptr;  // [tokens][top_k] global expert ids; others count nowhere
  int64_t tokens = 0, top_k = 0, num_experts = 0;
  int world_size = 1, rank = 0;
  uint64_t epoch = 0;  // this call's, >= 1, one more than the last call's
  // Each rank's [W][E] int64 count matrix of this call's parity, and its [W] uint64 arrival words.
  int64_t* peer_counts[kMaxFusedPeers] = {};
  uint64_t* peer_arrived[kMaxFusedPeers] = {};
  int32_t* offs = nullptr;  // [E / W] out: cumulative row ends of this rank's experts
  GateTimeout* timeout = nullptr;  // flag 4: expert = the rank that did not arrive
  uint64_t timeout_ns = 0;
};

// One block: counts this rank's entries per expert, stores them as row `rank` of every rank's
// matrix, releases its epoch to every rank, waits for every rank's, then writes offs from the
// full matrix. num_experts <= fused::kMaxExperts.
Status fused_exchange_counts(const FusedExchangeArgs& a, cudaStream_t stream);

}  // namespace uniep::cuda
