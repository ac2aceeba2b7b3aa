// The checks that the MegaKernel's forward (sm90_forward.cu) and backward
// (sm90_backward.cu) launches make alike: the layer's sizes, the pointers, and the SMs a
// launch runs on.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda::megakernel {

// tokens >= 0 and top_k in [1, 32] (a warp's lanes hold one token's entries), hidden and ffn
// positive multiples of 64, num_experts in [1, 2^20].
inline Status check_layer_sizes(int64_t tokens, int64_t top_k, int64_t hidden, int64_t ffn,
                                int64_t num_experts) {
  if (tokens < 0 || top_k < 1 || top_k > 32)
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat("tokens must be >= 0 and top_k in [1, 32], got ", tokens, " and ", top_k)};
  if (hidden <= 0 || hidden % 64 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("hidden must be a positive multiple of 64, got ", hidden)};
  if (ffn <= 0 || ffn % 64 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("ffn must be a positive multiple of 64, got ", ffn)};
  if (num_experts < 1 || num_experts > (1 << 20))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("num_experts must be in [1, 2^20], got ", num_experts)};
  return Status::Ok();
}

// Every pointer set (not null).
inline bool all_set(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (p == nullptr) return false;
  return true;
}

// Every pointer 16-byte aligned, as TMA and the 16-byte row copies need.
inline bool all_aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

// The SMs a launch on `device` runs on, into sm_count: `requested`, or all of the device's for
// 0; at least 2 (the kernels run in clusters of two CTAs). `what` names the kernel and `entry`
// the entry point in the errors.
inline Status launch_sm_count(int device, int requested, const char* what, const char* entry,
                              int& sm_count) {
  if (!grouped_gemm_device_ok(device))
    return {StatusCode::kUnsupported,
            detail::str_cat(what, " needs a compute capability 9.0 GPU (built for sm_90a)")};
  int device_sms = 0;
  if (cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return launch_status(detail::str_cat(entry, " (device attributes)").c_str());
  sm_count = requested == 0 ? device_sms : requested;
  if (sm_count < 2 || sm_count > device_sms)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be 0 (all) or in [2, ",
                                                          device_sms, "], got ", requested)};
  return Status::Ok();
}

}  // namespace uniep::cuda::megakernel
