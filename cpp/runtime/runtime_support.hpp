// Host-side pieces the UniEP runtimes (ep_runtime.cu, coll_runtime.cu, megakernel_runtime.cu)
// share: CUDA return codes as a Status, the offsets of one symmetric allocation, and the device
// error word. The allocation itself is nvshmem_session.hpp's SymmetricHeap.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/common/device_wait.cuh"
#include "uniep/status.hpp"

// The runtimes' API returns a Status and never throws, so a failed CUDA call returns one from
// the enclosing function, naming the call.
#define UNIEP_CUDA_OK(expr)                                                            \
  do {                                                                                 \
    const cudaError_t uniep_e_ = (expr);                                               \
    if (uniep_e_ != cudaSuccess)                                                       \
      return ::uniep::Status{                                                          \
          ::uniep::StatusCode::kInternal,                                              \
          ::uniep::detail::str_cat(#expr, " failed: ", cudaGetErrorString(uniep_e_))}; \
  } while (0)

namespace uniep::runtime {

// Every buffer carved from the symmetric allocation starts where a cudaMalloc of its own would.
constexpr size_t kAlign = 256;

inline size_t align_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// Hands out the offsets of consecutive buffers in one symmetric allocation. Every rank carves
// the same config in the same order, so an offset here is the offset on every peer.
class HeapCarver {
 public:
  size_t take(size_t bytes) {
    const size_t at = off_;
    off_ += align_up(bytes);
    return at;
  }
  size_t total() const { return off_; }

 private:
  size_t off_ = 0;
};

// A call whose host side stamps a fresh epoch or reads the device's results cannot be replayed
// from a CUDA graph: kUnsupported with the message str_cat(why...) while `stream` is capturing
// (built only then: the collectives call this on every call), Ok otherwise.
template <typename... Why>
Status refuse_capture(cudaStream_t stream, const Why&... why) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  UNIEP_CUDA_OK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    return {StatusCode::kUnsupported, detail::str_cat(why...)};
  return Status::Ok();
}

// The device error word lives in host-mapped memory that kernels write behind the host's back,
// hence the volatile reads. If a kernel recorded an error, returns describe(word) and clears the
// word so that the next call starts clean; Ok otherwise.
template <typename Describe>
Status take_device_error(cuda::DeviceError* word, Describe describe) {
  volatile cuda::DeviceError* e = word;
  if (e->op == 0) return Status::Ok();
  Status s = describe(*e);
  e->op = 0;
  return s;
}

// The Status of a bounded wait that gave up; hint says what the user most likely did wrong.
inline Status wait_timeout(const char* what, int64_t rank, double timeout_s,
                           const volatile cuda::DeviceError& e, const char* hint) {
  return {StatusCode::kTimeout,
          detail::str_cat("uniep ", what, " on rank ", rank, " timed out after ", timeout_s,
                          " s waiting for rank ", e.peer, " (signal ", e.have, ", expected ",
                          e.want, "); ", hint)};
}

// Runtime::create of the runtimes: validate the config, then bring up an Impl (which has
// `Status init(const std::vector<uint8_t>& unique_id)`); nothing is handed out on failure.
template <typename Impl, typename Base, typename Config>
Status create_runtime(const Config& config, const std::vector<uint8_t>& unique_id,
                      std::unique_ptr<Base>* runtime) {
  if (Status s = config.validate(); !s.ok()) return s;
  auto rt = std::make_unique<Impl>(config);
  if (Status s = rt->init(unique_id); !s.ok()) return s;
  *runtime = std::move(rt);
  return Status::Ok();
}

}  // namespace uniep::runtime
