// The 128 x 128-tile instantiation of sm90_gemm_kernel.cuh.
#include "cuda/gemm/sm90_gemm_configs.hpp"
#include "cuda/gemm/sm90_gemm_kernel.cuh"

namespace uniep::cuda {

size_t sm90_gemm_workspace_n128(const GemmOperands& op, const GemmTuning& tuning, int sm_count) {
  return Sm90Bf16Gemm<128>::workspace_bytes(op, tuning, sm_count);
}

Status sm90_gemm_run_n128(const GemmOperands& op, const GemmTuning& tuning, int device,
                          int sm_count, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  return Sm90Bf16Gemm<128>::run(op, tuning, device, sm_count, workspace, workspace_bytes, stream);
}

}  // namespace uniep::cuda
