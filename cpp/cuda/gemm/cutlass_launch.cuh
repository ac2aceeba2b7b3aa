// The launch of one CUTLASS device adapter (GemmUniversalAdapter), as a Status: every engine's
// kernels go through the same can_implement / initialize / run sequence, and their errors say
// which GEMM failed and CUTLASS's and CUDA's reasons.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/cutlass.h>

#include "uniep/status.hpp"

namespace uniep::cuda {

// `what` names the GEMM in the errors ("the fp8 grouped GEMM").
template <class Device>
Status launch_cutlass(const typename Device::Arguments& args, void* workspace,
                      cudaStream_t stream, const char* what) {
  Device gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return {StatusCode::kUnsupported, detail::str_cat(what, " cannot implement these operands")};
  cutlass::Status s = gemm.initialize(args, workspace, stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess)
    return {StatusCode::kInternal,
            detail::str_cat(what, " failed to launch: ", cutlassGetStatusString(s), " (",
                            cudaGetErrorString(cudaGetLastError()), ")")};
  return Status::Ok();
}

}  // namespace uniep::cuda
