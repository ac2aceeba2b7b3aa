// CUDA implementations of uniep::routing_layout and uniep::expert_rows. Built only against a torch
// with CUDA; the kernels themselves live in libuniep_cuda (cpp/cuda/dispatch) behind plain-pointer
// APIs.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>

#include "cuda/dispatch/expert_rows.hpp"
#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/dispatch/expert_rows.hpp"
#include "uniep/cuda/layout.hpp"

namespace uniep::torch_glue {
namespace {

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
    ok_or_throw(cuda::validate_routing_layout(tokens, top_k, num_experts, world_size));

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
    ok_or_throw(cuda::routing_layout_async(
        idx, tokens, top_k, num_experts, world_size, per_rank.data_ptr<int64_t>(),
        per_expert.data_ptr<int64_t>(), in_rank.data_ptr<bool>(), error_ptr, stream));
    if (!capturing) {
      ok_or_throw(cuda::check_routing_layout(idx, top_k, num_experts, error_ptr, stream));
    }
    return std::make_tuple(per_rank, per_expert, in_rank);
  });
}

// The dispatch's row-list kernels on caller-given metadata. The output length is data-dependent,
// so this op reads it on the host (one sync, with the value checks): not for graph capture.
std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_rows_cuda(const at::Tensor& recv_src,
                                                                const at::Tensor& recv_topk_idx,
                                                                const at::Tensor& recv_from_rank,
                                                                int64_t rank, int64_t num_experts,
                                                                int64_t max_tokens) {
  return translate_errors([&] {
    const ExpertRowsDims d = check_expert_rows_args(recv_src, recv_topk_idx, recv_from_rank, rank,
                                                    num_experts, max_tokens, Executor::kCuda);
    UNIEP_CHECK(d.experts_per_rank <= cuda::expert_rows_max_experts(),
                "num_experts / world_size (experts per rank) must be at most ",
                cuda::expert_rows_max_experts(), " on CUDA, got ", d.experts_per_rank);
    const c10::cuda::CUDAGuard guard(recv_src.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(recv_src.device().index());
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    UNIEP_CHECK(capture == cudaStreamCaptureStatusNone,
                "expert_rows cannot be captured in a CUDA graph: its output length is read on "
                "the host; the dispatch (ep_dispatch) returns the row lists of its own round");
    const at::Tensor src = recv_src.contiguous(), ids = recv_topk_idx.contiguous();
    const int64_t El = d.experts_per_rank, units = (d.slots + 31) / 32;
    const auto i64 = ids.options();
    at::Tensor recv_offsets = at::zeros({d.world_size + 1}, i64);
    recv_offsets.slice(0, 1).copy_(recv_from_rank.cumsum(0));
    at::Tensor expert_offsets = at::zeros({El + 1}, i64);
    at::Tensor scratch = at::empty(
        {static_cast<int64_t>(cuda::expert_rows_scratch_bytes(d.slots, El) / sizeof(int64_t))},
        i64);
    cuda::ExpertRowsArgs a{src.data_ptr<int64_t>(),
                           ids.data_ptr<int64_t>(),
                           1,
                           d.top_k,
                           d.slots,
                           recv_offsets.data_ptr<int64_t>(),
                           expert_offsets.data_ptr<int64_t>(),
                           d.world_size,
                           d.first_expert,
                           El,
                           d.top_k,
                           max_tokens,
                           scratch.data_ptr<int64_t>(),
                           nullptr,
                           nullptr,
                           nullptr};
    // Rows per local expert from the kernels' own count; R and the value checks reach the host
    // in one copy, and only a flawed input pays for the checks that name the entry.
    cuda::launch_expert_rows_count(a, stream);
    C10_CUDA_CHECK(cudaGetLastError());
    const at::Tensor per_expert = d.slots > 0
                                      ? scratch.slice(0, 0, El * units).view({El, units}).sum(1)
                                      : at::zeros({El}, i64);
    expert_offsets.slice(0, 1).copy_(per_expert.cumsum(0));
    const at::Tensor flaw =
        expert_rows_input_flaw(recv_src, recv_topk_idx, recv_from_rank, num_experts, max_tokens, d);
    const at::Tensor host = at::stack({expert_offsets[El], flaw}).cpu();
    if (host[1].item<int64_t>() != 0)
      check_expert_rows_values(recv_src, recv_topk_idx, recv_from_rank, num_experts, max_tokens, d);
    const int64_t R = host[0].item<int64_t>();
    at::Tensor row_slot = at::empty({R}, i64), row_target = at::empty({R}, i64);
    a.row_slot = row_slot.data_ptr<int64_t>();
    a.row_target = row_target.data_ptr<int64_t>();
    cuda::launch_expert_rows_place(a, stream);
    C10_CUDA_CHECK(cudaGetLastError());
    return std::make_tuple(row_slot, row_target, per_expert);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("routing_layout", &uniep::torch_glue::routing_layout_cuda);
  m.impl("expert_rows", &uniep::torch_glue::expert_rows_cuda);
}
