// The CTA's index in its grid, x fastest, then y, then z: the one numbering of the MegaKernel's
// per-CTA records (trace and tile stamps, gate wait times, held-signal slots), so that every
// record of one CTA lands in the same row whatever the grid's shape.
#pragma once

#include <cstdint>

namespace uniep::cuda {

__device__ __forceinline__ int64_t cta_linear_index() {
  return static_cast<int64_t>(blockIdx.x) +
         static_cast<int64_t>(gridDim.x) *
             (static_cast<int64_t>(blockIdx.y) + static_cast<int64_t>(gridDim.y) * blockIdx.z);
}

}  // namespace uniep::cuda
