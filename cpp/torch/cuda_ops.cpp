// CUDA implementations of the uniep ops. Built only against a torch with CUDA; the kernels
// themselves live in libuniep_cuda (cpp/cuda) behind the plain-pointer API of include/uniep/cuda.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>

#include "torch/validate.hpp"
#include "uniep/cuda/layout.hpp"

namespace uniep::torch_glue {
namespace {

void throw_if_error(const Status& status) {
  if (!status.ok()) throw Error(status.code, status.message);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> routing_layout_cuda(const at::Tensor& topk_idx,
                                                                   int64_t num_experts,
                                                                   int64_t world_size) {
  return translate_errors([&] {
    check_topk_idx(topk_idx);
    UNIEP_CHECK(topk_idx.device().is_cuda(), "topk_idx must be a CUDA tensor here, got ",
                topk_idx.device());
    const int64_t tokens = topk_idx.size(0);
    const int64_t top_k = topk_idx.size(1);
    // Before allocating: a negative world_size must be a ValueError, not a failed allocation.
    throw_if_error(cuda::validate_routing_layout(tokens, top_k, num_experts, world_size));

    const c10::cuda::CUDAGuard guard(topk_idx.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(topk_idx.device().index());
    const auto i64 = topk_idx.options().dtype(at::kLong);
    at::Tensor per_rank = at::empty({world_size}, i64);
    at::Tensor per_expert = at::empty({num_experts}, i64);
    at::Tensor in_rank = at::empty({tokens, world_size}, topk_idx.options().dtype(at::kBool));

    // Reporting a bad expert id needs a host read, i.e. a stream sync, which graph capture forbids:
    // under capture the kernel traps on a bad id instead (nothing is dropped silently either way).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool capturing = capture != cudaStreamCaptureStatusNone;
    // From the caching allocator, so the eager path costs no cudaMalloc.
    at::Tensor error_word = capturing ? at::Tensor() : at::empty({1}, i64);
    auto* error_ptr =
        capturing ? nullptr : reinterpret_cast<unsigned long long*>(error_word.data_ptr<int64_t>());

    const int64_t* idx = topk_idx.data_ptr<int64_t>();
    throw_if_error(cuda::routing_layout_async(
        idx, tokens, top_k, num_experts, world_size, per_rank.data_ptr<int64_t>(),
        per_expert.data_ptr<int64_t>(), in_rank.data_ptr<bool>(), error_ptr, stream));
    if (!capturing) {
      throw_if_error(cuda::check_routing_layout(idx, top_k, num_experts, error_ptr, stream));
    }
    return std::make_tuple(per_rank, per_expert, in_rank);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("routing_layout", &uniep::torch_glue::routing_layout_cuda);
}
