// The fused MoE kernel with cooperative 128 x 256 x 64 tiles, GEMM 1 reading w1 as the model
// stores it (gate columns, then up; FusedMoeArgs::w1_as_stored): kernel.cuh instantiated
// once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

size_t fused_gemm_workspace_128_stored(int64_t num_experts, int sm_count) {
  return fused_gemm_workspace_impl<FusedGemm<128, true>>(num_experts, sm_count);
}

Status fused_launch_128_stored(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                               int skip_rounds, const FusedScratch& scratch, int device,
                               int sm_count, cudaStream_t stream) {
  return fused_launch_impl<FusedGemm<128, true>>(ws, a, comm_units, skip_rounds, scratch, device,
                                                 sm_count, stream);
}

}  // namespace uniep::cuda::megakernel
