// The instantiations of sm90_gemm_kernel.cuh, one per tile width, for the dispatcher
// (sm90_gemm.cu), which includes no CUTLASS header.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cuda/gemm/gemm.hpp"

namespace uniep::cuda {

// Defined in sm90_bf16_gemm_n<TileN>.cu.
size_t sm90_gemm_workspace_n128(const GemmOperands& op, const GemmTuning& tuning, int sm_count);
size_t sm90_gemm_workspace_n256(const GemmOperands& op, const GemmTuning& tuning, int sm_count);
Status sm90_gemm_run_n128(const GemmOperands& op, const GemmTuning& tuning, int device,
                          int sm_count, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);
Status sm90_gemm_run_n256(const GemmOperands& op, const GemmTuning& tuning, int device,
                          int sm_count, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream);

}  // namespace uniep::cuda
