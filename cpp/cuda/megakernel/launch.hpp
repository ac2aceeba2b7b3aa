// The fused MoE kernel's instantiations (kernel.cuh), one per tile height, each defined in
// its own sm90_forward_<tile_m>.cu; sm90_forward.cu checks the arguments and picks one.
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

size_t fused_gemm_workspace_128(int64_t num_experts, int sm_count);
size_t fused_gemm_workspace_64(int64_t num_experts, int sm_count);

Status fused_launch_128(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                        int skip_rounds, const FusedScratch& scratch, int device, int sm_count,
                        cudaStream_t stream);
Status fused_launch_64(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                       int skip_rounds, const FusedScratch& scratch, int device, int sm_count,
                       cudaStream_t stream);

// The same with GEMM 1 reading w1 as stored (FusedMoeArgs::w1_as_stored), in
// sm90_forward_<tile_m>_stored.cu.
size_t fused_gemm_workspace_128_stored(int64_t num_experts, int sm_count);
size_t fused_gemm_workspace_64_stored(int64_t num_experts, int sm_count);
Status fused_launch_128_stored(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                               int skip_rounds, const FusedScratch& scratch, int device,
                               int sm_count, cudaStream_t stream);
Status fused_launch_64_stored(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                              int skip_rounds, const FusedScratch& scratch, int device,
                              int sm_count, cudaStream_t stream);

}  // namespace uniep::cuda::megakernel
