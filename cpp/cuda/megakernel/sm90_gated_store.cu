// The gated grouped GEMM with the plain store epilogue (the MegaKernel's second expert GEMM).
#include "cuda/megakernel/gated_run.cuh"

namespace uniep::cuda::megakernel {

size_t gated_store_workspace(int64_t num_experts, int sm_count) {
  return gated_gemm_workspace<grouped::GroupedEpilogue::kStore>(num_experts, sm_count);
}

Status gated_store_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                       int device, int sm_count, cudaStream_t stream, const GatedOrder& order) {
  return gated_gemm_run<grouped::GroupedEpilogue::kStore>(ws, num_experts, gate, GatedSignal{}, 0,
                                                          device, sm_count, stream, {}, order);
}

}  // namespace uniep::cuda::megakernel
