// The fused MoE kernel with ping-pong 64 x 256 x 64 tiles (experts of a few hundred rows):
// kernel.cuh instantiated once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

size_t fused_gemm_workspace_64(int64_t num_experts, int sm_count) {
  return fused_gemm_workspace_impl<FusedGemm<64>>(num_experts, sm_count);
}

Status fused_launch_64(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                       int skip_rounds, const FusedScratch& scratch, int device, int sm_count,
                       cudaStream_t stream) {
  return fused_launch_impl<FusedGemm<64>>(ws, a, comm_units, skip_rounds, scratch, device, sm_count,
                                          stream);
}

}  // namespace uniep::cuda::megakernel
