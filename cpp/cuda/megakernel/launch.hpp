// The fused MoE kernel's instantiations (kernel.cuh), one per tile shape, each defined in its
// own sm90_forward_<shape>.cu; sm90_forward.cu checks the arguments and picks one.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda::megakernel {

// The fused kernel's CTA: a producer warpgroup, then two consumer warpgroups.
constexpr int kFusedProducerWarps = 4;
constexpr int kFusedConsumerWarps = 8;

// The launch's own scratch in the workspace, after the GEMM body's (sm90_forward.cu carves it).
struct FusedScratch {
  // The reduce's next token, zeroed by fused_problems before each launch.
  uint32_t* reduce_ticket = nullptr;
  // Per (CTA, consumer warp): the GEMM-2 signal a warp still holds when its tiles are done
  // (FusedMoeEpilogue::held), num_held of them.
  uint32_t** held = nullptr;
  int64_t num_held = 0;
};

// Bytes of FusedScratch::held for sm_count CTAs.
inline size_t fused_held_bytes(int sm_count) {
  return grouped::round_up(static_cast<size_t>(sm_count) * kFusedConsumerWarps * sizeof(uint32_t*));
}

// One instantiation of the fused kernel (kernel.cuh's FusedGemm), each defined in its own
// sm90_forward_<shape>.cu so that they compile in parallel: its shape and its two entry points.
struct FusedEntry {
  int tile_m = 0, tile_n = 0, cluster_m = 0;
  bool w1_as_stored = false;
  // Bytes of the GEMM body's own workspace (per-SM tensor maps) for E experts on sm_count SMs.
  size_t (*gemm_workspace)(int64_t num_experts, int sm_count) = nullptr;
  // The launch over the problem arrays in `ws` (fused_problems filled them), the first
  // comm_units cluster units sending, the others taking skip_rounds rounds first.
  Status (*launch)(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                   int skip_rounds, const FusedScratch& scratch, int device, int sm_count,
                   cudaStream_t stream) = nullptr;
};

const FusedEntry& fused_entry_128();         // cooperative 128 x 256, clusters of two
const FusedEntry& fused_entry_64();          // ping-pong 64 x 256, clusters of two
const FusedEntry& fused_entry_64_n128();     // ping-pong 64 x 128, clusters of one (decode)
const FusedEntry& fused_entry_128_stored();  // the same three reading w1 as stored
const FusedEntry& fused_entry_64_stored();
const FusedEntry& fused_entry_64_n128_stored();

}  // namespace uniep::cuda::megakernel
