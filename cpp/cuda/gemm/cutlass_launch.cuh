// The launch of one CUTLASS device adapter (GemmUniversalAdapter), as a Status: every engine's
// kernels go through the same can_implement / initialize / run sequence, and their errors say
// which GEMM failed and CUTLASS's and CUDA's reasons. And the launch of a kernel of our own that
// runs a CUTLASS kernel body inside it (the MegaKernel's forward and backward).
#pragma once

#include <cuda_runtime.h>

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

// `what` names the GEMM in the errors ("the fp8 grouped GEMM").
template <class Device>
Status launch_cutlass(const typename Device::Arguments& args, void* workspace, cudaStream_t stream,
                      const char* what) {
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

// The params of the CUTLASS kernel body `Kernel` (a GemmUniversal) for `args`, its workspace
// initialized on `stream`, for launch_with_body. `what` names the kernel in the errors.
template <class Kernel>
Status body_params(const typename Kernel::Arguments& args, void* workspace, cudaStream_t stream,
                   const char* what, typename Kernel::Params* params) {
  if (!Kernel::can_implement(args))
    return {StatusCode::kUnsupported, detail::str_cat(what, " cannot implement these operands")};
  if (Kernel::initialize_workspace(args, workspace, stream) != cutlass::Status::kSuccess)
    return {StatusCode::kInternal, detail::str_cat(what, "'s workspace failed to initialize")};
  *params = Kernel::to_underlying_arguments(args, workspace);
  return Status::Ok();
}

// `kernel` runs the CUTLASS kernel body `Kernel` (a GemmUniversal, called with params and its
// dynamic shared memory) among other work: launched as the body needs, on its grid and block,
// with its shared memory and in clusters of its cluster shape. `args` follow params.
// `what` names the launch in the errors. `after_prior`: a programmatic dependent launch (the
// kernel waits for the one ahead of it itself: common/dependent_launch.cuh).
template <class Kernel, class... Expected, class... Actual>
Status launch_with_body(void (*kernel)(Expected...), const typename Kernel::Params& params,
                        cudaStream_t stream, const char* what, bool after_prior,
                        const Actual&... args) {
  const int smem = static_cast<int>(Kernel::SharedStorageSize);
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) !=
      cudaSuccess)
    return launch_status(detail::str_cat(what, " (shared memory attribute)").c_str());
  cudaLaunchConfig_t config{};
  config.gridDim = Kernel::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cute::size<0>(typename Kernel::ClusterShape{});
  attr[0].val.clusterDim.y = cute::size<1>(typename Kernel::ClusterShape{});
  attr[0].val.clusterDim.z = 1;
  attr[1] = programmatic_launch_attribute();
  config.attrs = attr;
  config.numAttrs = after_prior ? 2 : 1;
  if (cudaLaunchKernelEx(&config, kernel, params, args...) != cudaSuccess)
    return launch_status(what);
  return launch_status(what);
}

}  // namespace uniep::cuda
