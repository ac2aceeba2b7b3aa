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
  uint64_t epoch = 0;  // this call's, >= 1, one more than the last call's (or epoch_word below)
  // Each rank's [W][E] int64 count matrix of this call's parity, and its [W] uint64 arrival words.
  int64_t* peer_counts[kMaxFusedPeers] = {};
  uint64_t* peer_arrived[kMaxFusedPeers] = {};
  int32_t* offs = nullptr;  // [E / W] out: cumulative row ends of this rank's experts
  GateTimeout* timeout = nullptr;  // flag 4: expert = the rank that did not arrive
  uint64_t timeout_ns = 0;
  // The epoch on the device, so that a CUDA graph of the call can be replayed: when set, the
  // call's epoch is *epoch_word + 1, written back at the end (`epoch` above is not read), its
  // parity picks the count matrices (peer_counts are parity 0's, parity 1's lie
  // counts_parity_stride entries further), the zero_count words at zero_always[0], [1] and at
  // zero_by_parity + parity x zero_count are zeroed before this rank announces the call, and
  // this call's own matrix is copied to counts_out (for the plan, whose pointer cannot follow
  // the parity).
  uint64_t* epoch_word = nullptr;
  int64_t counts_parity_stride = 0;
  uint32_t* zero_always[2] = {};
  uint32_t* zero_by_parity = nullptr;
  int64_t zero_count = 0;
  int64_t* counts_out = nullptr;  // [W][E]
};

// One block: counts this rank's entries per expert, stores them as row `rank` of every rank's
// matrix, releases its epoch to every rank, waits for every rank's, then writes offs from the
// full matrix. num_experts <= fused::kMaxExperts.
Status fused_exchange_counts(const FusedExchangeArgs& a, cudaStream_t stream);

}  // namespace uniep::cuda
