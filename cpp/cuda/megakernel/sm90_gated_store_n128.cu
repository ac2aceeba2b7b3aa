// The gated grouped GEMM with the plain store epilogue at 128 x 128 tiles: the part GEMM's tile
// where the 256-wide tiles would leave much of the last wave idle (part_gemm.cu's rule).
#include "cuda/megakernel/gated_run.cuh"

namespace uniep::cuda::megakernel {

size_t gated_store_n128_workspace(int64_t num_experts, int sm_count) {
  return gated_gemm_workspace<grouped::GroupedEpilogue::kStore, 128>(num_experts, sm_count);
}

Status gated_store_n128_run(const grouped::Workspace& ws, int64_t num_experts, const TileGate& gate,
                            int device, int sm_count, cudaStream_t stream,
                            const GatedOrder& order) {
  return gated_gemm_run<grouped::GroupedEpilogue::kStore, 128>(
      ws, num_experts, gate, GatedSignal{}, 0, device, sm_count, stream, {}, order);
}

}  // namespace uniep::cuda::megakernel
