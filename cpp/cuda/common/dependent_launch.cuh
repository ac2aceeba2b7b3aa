// Programmatic dependent launch (sm_90): a kernel launched with programmatic_launch_attribute()
// may start while the kernel ahead of it in the stream still runs. It must call
// wait_for_prior_grid() before it reads anything that kernel writes; the kernel ahead lets it
// start early with allow_next_grid(), or else it starts once that kernel's CTAs have all exited.
// Why: a decode step is a chain of short launches, whose launch latencies then overlap the
// kernels ahead of them instead of adding up. Captured in a CUDA graph, the dependency stays
// programmatic.
#pragma once

#include <cuda_runtime.h>

namespace uniep::cuda {

inline cudaLaunchAttribute programmatic_launch_attribute() {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return attr;
}

// Returns once the kernel ahead has finished and its stores are visible; at once where this
// kernel was launched without the attribute (the kernel ahead had finished before it started).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the kernel behind this one start its CTAs now, if it was launched with the attribute.
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// `kernel` on (grid, block, smem) launched with programmatic_launch_attribute(): it must call
// wait_for_prior_grid() before it reads what the kernel ahead writes, and before it ends (a
// kernel behind it that waits on it then waits on the one ahead too). Returns the launch's error.
template <class... Expected, class... Actual>
cudaError_t launch_after_prior(void (*kernel)(Expected...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t stream, const Actual&... args) {
  cudaLaunchAttribute attr = programmatic_launch_attribute();
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

}  // namespace uniep::cuda
