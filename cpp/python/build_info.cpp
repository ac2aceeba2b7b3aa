#include "python/build_info.hpp"

#ifndef UNIEP_VERSION
#define UNIEP_VERSION "unknown"
#endif
#ifndef UNIEP_NVSHMEM_VERSION
#define UNIEP_NVSHMEM_VERSION ""
#endif
#ifndef UNIEP_CUTLASS_VERSION
#define UNIEP_CUTLASS_VERSION ""
#endif
#ifndef UNIEP_CUDA_ARCHS
#define UNIEP_CUDA_ARCHS ""
#endif
#ifndef UNIEP_CUDA_COMPILER_VERSION
#define UNIEP_CUDA_COMPILER_VERSION ""
#endif
#ifndef UNIEP_TORCH_VERSION
#define UNIEP_TORCH_VERSION ""
#endif

namespace uniep::python {

std::map<std::string, std::string> build_info_strings() {
  return {{"version", UNIEP_VERSION},
          {"nvshmem_version", UNIEP_NVSHMEM_VERSION},
          {"cutlass_version", UNIEP_CUTLASS_VERSION},
          {"cuda_archs", UNIEP_CUDA_ARCHS},
          {"cuda_compiler_version", UNIEP_CUDA_COMPILER_VERSION},
          {"torch_version", UNIEP_TORCH_VERSION}};
}

bool built_cuda_kernels() {
#ifdef UNIEP_BUILT_CUDA
  return true;
#else
  return false;
#endif
}

bool built_cuda_ops() {
#ifdef UNIEP_WITH_CUDA_OPS
  return true;
#else
  return false;
#endif
}

}  // namespace uniep::python
