// The gated grouped GEMM with the SwiGLU epilogue on w1 as stored (kSwiGluPlain: gate columns,
// then up, read in 64-column blocks by PlainGateUpMainloop) and its done signal.
#include "cuda/megakernel/gated_run.cuh"

namespace uniep::cuda::megakernel {

size_t gated_swiglu_plain_workspace(int64_t num_experts, int sm_count) {
  return gated_gemm_workspace<grouped::GroupedEpilogue::kSwiGluPlain>(num_experts, sm_count);
}

Status gated_swiglu_plain_run(const grouped::Workspace& ws, int64_t num_experts,
                              const TileGate& gate, const GatedSignal& signal, int64_t ld_out,
                              int device, int sm_count, cudaStream_t stream,
                              const grouped::PlainW1& plain) {
  return gated_gemm_run<grouped::GroupedEpilogue::kSwiGluPlain>(
      ws, num_experts, gate, signal, ld_out, device, sm_count, stream, plain);
}

}  // namespace uniep::cuda::megakernel
