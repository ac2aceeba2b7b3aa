// The gated grouped GEMM with the SwiGLU epilogue and its done signal (the MegaKernel's first
// expert GEMM).
#include "cuda/megakernel/gated_run.cuh"

namespace uniep::cuda::megakernel {

size_t gated_swiglu_workspace(int64_t num_experts, int sm_count) {
  return gated_gemm_workspace<grouped::GroupedEpilogue::kSwiGlu>(num_experts, sm_count);
}

Status gated_swiglu_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                        const GatedSignal& signal, int64_t ld_out, int device, int sm_count,
                        cudaStream_t stream) {
  return gated_gemm_run<grouped::GroupedEpilogue::kSwiGlu>(ws, num_experts, gate, signal, ld_out,
                                                           device, sm_count, stream);
}

}  // namespace uniep::cuda::megakernel
