// The Status of the launch just made on this thread, for the engine's small row kernels.
#pragma once

#include <cuda_runtime.h>

#include "uniep/status.hpp"

namespace uniep::cuda {

inline Status launch_status(const char* what) {
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat(what, " failed to launch: ", cudaGetErrorString(e))};
  return Status::Ok();
}

}  // namespace uniep::cuda
