// What the GPU examples share: exiting with a message on a failed call, and bf16 on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <uniep/status.hpp>

namespace example {

inline void check(const uniep::Status& status, const char* what) {
  if (!status.ok()) {
    std::printf("FAILED: %s: %s (%s)\n", what, status.message.c_str(),
                uniep::status_code_name(status.code));
    std::exit(1);
  }
}

inline void check_cuda(cudaError_t error, const char* what) {
  if (error != cudaSuccess) {
    std::printf("FAILED: %s: %s\n", what, cudaGetErrorString(error));
    std::exit(1);
  }
}

// bf16 is the top half of an fp32; rounding to nearest even (the values here are finite).
inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

}  // namespace example
