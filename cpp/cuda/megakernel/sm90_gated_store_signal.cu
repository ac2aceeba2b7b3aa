// The gated grouped GEMM with the signalling store epilogue (the part GEMM of a GEMM +
// reduce-scatter: each finished row block announced to the pushes that send it on).
#include "cuda/megakernel/gated_run.cuh"

namespace uniep::cuda::megakernel {

size_t gated_store_signal_workspace(int64_t num_experts, int sm_count) {
  return gated_gemm_workspace<grouped::GroupedEpilogue::kStoreSignal>(num_experts, sm_count);
}

Status gated_store_signal_run(const grouped::Workspace& ws, int64_t num_experts,
                              const TileGate& gate, const GatedSignal& signal, int64_t ld_out,
                              int device, int sm_count, cudaStream_t stream,
                              const GatedOrder& order) {
  return gated_gemm_run<grouped::GroupedEpilogue::kStoreSignal>(
      ws, num_experts, gate, signal, ld_out, device, sm_count, stream, {}, order);
}

}  // namespace uniep::cuda::megakernel
