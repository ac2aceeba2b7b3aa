// CUDA implementations of uniep::sender_rows and uniep::send_rows (schemas in registration.cpp):
// the MegaKernel's dispatch on its own (include/uniep/cuda/send_rows.hpp), so it can be tested
// against the CPU implementation and run beside a gated GEMM. No host sync: the error word is
// returned for the caller to read once the stream has run (uniep.moe.tile_gates.check_send_error).
// Also keep_first_errors, which folds such words into the sticky words of deferred checks
// (include/uniep/cuda/error_words.hpp).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/megakernel/local_plan.hpp"
#include "torch/megakernel/send_rows_ops.hpp"
#include "uniep/cuda/error_words.hpp"
#include "uniep/cuda/send_rows.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::torch_glue {

LocalPlanTensors local_plan_on_stream(const at::Tensor& topk_idx, int64_t num_experts,
                                      int64_t tile_m, cudaStream_t stream) {
  check_expert_tiles_args(topk_idx, num_experts, tile_m);
  auto [counts, offs, base] = empty_expert_tiles(topk_idx, num_experts);
  at::Tensor plan = at::empty({3, topk_idx.size(0), topk_idx.size(1)}, topk_idx.options());
  at::Tensor error = at::empty({1}, topk_idx.options());  // zeroed by the call
  cuda::LocalPlanArgs a;
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.tokens = topk_idx.size(0);
  a.top_k = topk_idx.size(1);
  a.num_experts = num_experts;
  a.tile_m = static_cast<int>(tile_m);
  a.counts = counts.data_ptr<int64_t>();
  a.offs = offs.data_ptr<int32_t>();
  a.tile_base = base.data_ptr<int32_t>();
  a.dest_rank = plan[0].data_ptr<int64_t>();
  a.gemm_row = plan[1].data_ptr<int64_t>();
  a.counter = plan[2].data_ptr<int64_t>();
  a.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  const size_t bytes = cuda::local_plan_workspace_bytes(topk_idx.numel(), num_experts);
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(bytes)}, topk_idx.options().dtype(at::kByte));
  ok_or_throw(cuda::plan_local_rows_async(a, workspace.data_ptr(), bytes, stream));
  return std::make_tuple(counts, offs, base, plan[0], plan[1], plan[2], error);
}

namespace {

// The plan kernel's arguments for this call; outputs [3, T, K] (dest_rank, gemm_row, counter)
// and error [1] are the caller's.
cuda::SenderRowsPlanArgs plan_args(const at::Tensor& topk_idx, const at::Tensor& expert_counts,
                                   int64_t rank, int64_t tile_m, at::Tensor& plan,
                                   at::Tensor& error) {
  cuda::SenderRowsPlanArgs a;
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.tokens = topk_idx.size(0);
  a.top_k = topk_idx.size(1);
  a.counts = expert_counts.data_ptr<int64_t>();
  a.counts_ld = expert_counts.size(1);
  a.world_size = expert_counts.size(0);
  a.rank = rank;
  a.num_experts = expert_counts.size(1);
  a.tile_m = static_cast<int>(tile_m);
  a.dest_rank = plan[0].data_ptr<int64_t>();
  a.gemm_row = plan[1].data_ptr<int64_t>();
  a.counter = plan[2].data_ptr<int64_t>();
  a.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  return a;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sender_rows_cuda(
    const at::Tensor& topk_idx, const at::Tensor& expert_counts, int64_t rank, int64_t tile_m) {
  return translate_errors([&] {
    check_sender_rows_args(topk_idx, expert_counts, rank, tile_m);
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    at::Tensor plan = at::empty({3, topk_idx.size(0), topk_idx.size(1)}, topk_idx.options());
    at::Tensor error = at::zeros({1}, topk_idx.options());
    const cuda::SenderRowsPlanArgs a =
        plan_args(topk_idx, expert_counts, rank, tile_m, plan, error);
    ok_or_throw(cuda::plan_sender_rows_async(a, at::cuda::getCurrentCUDAStream().stream()));
    return std::make_tuple(plan[0], plan[1], plan[2], error);
  });
}

at::Tensor send_order_cuda(const at::Tensor& topk_idx, const at::Tensor& expert_counts,
                           int64_t rank) {
  return translate_errors([&] {
    check_sender_rows_args(topk_idx, expert_counts, rank, 1);
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    at::Tensor plan = at::empty({3, topk_idx.size(0), topk_idx.size(1)}, topk_idx.options());
    at::Tensor error = at::zeros({1}, topk_idx.options());
    at::Tensor order = at::full({topk_idx.numel()}, -1, topk_idx.options());
    cuda::SenderRowsPlanArgs a = plan_args(topk_idx, expert_counts, rank, 1, plan, error);
    a.send_order = order.data_ptr<int64_t>();
    ok_or_throw(cuda::plan_sender_rows_async(a, at::cuda::getCurrentCUDAStream().stream()));
    return order;
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_tiles_cuda(const at::Tensor& topk_idx,
                                                                 int64_t num_experts,
                                                                 int64_t tile_m) {
  return translate_errors([&] {
    check_expert_tiles_args(topk_idx, num_experts, tile_m);
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    auto [counts, offs, base] = empty_expert_tiles(topk_idx, num_experts);
    const size_t bytes = cuda::expert_tiles_workspace_bytes(num_experts);
    at::Tensor workspace =
        at::empty({static_cast<int64_t>(bytes)}, topk_idx.options().dtype(at::kByte));
    ok_or_throw(cuda::expert_tiles(
        topk_idx.data_ptr<int64_t>(), topk_idx.numel(), num_experts, static_cast<int>(tile_m),
        counts.data_ptr<int64_t>(), offs.data_ptr<int32_t>(), base.data_ptr<int32_t>(),
        workspace.data_ptr(), bytes, at::cuda::getCurrentCUDAStream().stream()));
    return std::make_tuple(counts, offs, base);
  });
}

LocalPlanTensors local_plan_cuda(const at::Tensor& topk_idx, int64_t num_experts, int64_t tile_m) {
  return translate_errors([&] {
    const c10::cuda::CUDAGuard guard(topk_idx.device());
    return local_plan_on_stream(topk_idx, num_experts, tile_m,
                                at::cuda::getCurrentCUDAStream().stream());
  });
}

// The world-1 form: the peer table holds this rank's own rows and counters only.
at::Tensor send_rows_cuda(const at::Tensor& x, const at::Tensor& dest_rank,
                          const at::Tensor& gemm_row, const at::Tensor& counter,
                          const at::Tensor& rows, const at::Tensor& counters, int64_t sm_count) {
  return translate_errors([&] {
    check_send_rows_args(x, dest_rank, gemm_row, counter, rows, counters);
    UNIEP_CHECK(x.device().is_cuda(), "x must be a CUDA tensor, got ", x.device());
    int device_sms = 0;
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, x.device().index()));
    UNIEP_CHECK(sm_count >= 1 && sm_count <= device_sms, "sm_count must be in [1, ", device_sms,
                "], got ", sm_count);
    const c10::cuda::CUDAGuard guard(x.device());
    at::Tensor error = at::zeros({1}, x.options().dtype(at::kLong));
    cuda::SendRowsArgs a;
    a.x = x.data_ptr();
    a.row_bytes = x.size(1) * x.element_size();
    a.x_stride = a.row_bytes;
    a.tokens = x.size(0);
    a.top_k = dest_rank.size(1);
    a.dest_rank = dest_rank.data_ptr<int64_t>();
    a.gemm_row = gemm_row.data_ptr<int64_t>();
    a.counter = counter.data_ptr<int64_t>();
    a.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
    cuda::RowPeers peers;
    peers.num_peers = 1;
    peers.rows[0] = static_cast<uint8_t*>(rows.data_ptr());
    peers.counters[0] = reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>());
    peers.row_stride = rows.size(1) * rows.element_size();
    peers.rows_capacity = rows.size(0);
    peers.num_counters = counters.size(0);
    ok_or_throw(cuda::send_rows_async(a, peers, static_cast<int>(sm_count),
                                      at::cuda::getCurrentCUDAStream().stream()));
    return error;
  });
}

std::tuple<at::Tensor, at::Tensor> combine_rows_cuda(const at::Tensor& y,
                                                     const at::Tensor& gemm_row,
                                                     const at::Tensor& topk_weights, bool report) {
  return translate_errors([&] {
    check_combine_rows_args(y, gemm_row, topk_weights);
    UNIEP_CHECK(y.device().is_cuda(), "y must be a CUDA tensor, got ", y.device());
    const c10::cuda::CUDAGuard guard(y.device());
    const int64_t T = gemm_row.size(0), H = y.size(1);
    at::Tensor out = at::empty({T, H}, y.options());
    // Without report no word is filled: one launch fewer in a decode step.
    at::Tensor error =
        report ? at::zeros({1}, gemm_row.options()) : at::empty({0}, gemm_row.options());
    int device_sms = 0;
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, y.device().index()));
    ok_or_throw(cuda::combine_rows_bf16(
        y.data_ptr(), y.size(0), gemm_row.data_ptr<int64_t>(), topk_weights.data_ptr<float>(), T,
        gemm_row.size(1), H, out.data_ptr(),
        report ? reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>()) : nullptr,
        device_sms * 4, at::cuda::getCurrentCUDAStream().stream()));
    return std::make_tuple(out, error);
  });
}

void keep_first_errors_cuda(const std::vector<at::Tensor>& sticky,
                            const std::vector<at::Tensor>& words) {
  translate_errors([&] {
    check_keep_first_errors_args(sticky, words);
    if (sticky.empty()) return;
    UNIEP_CHECK(sticky[0].device().is_cuda(), "sticky must be CUDA tensors, got ",
                sticky[0].device());
    const c10::cuda::CUDAGuard guard(sticky[0].device());
    std::vector<cuda::ErrorWordPair> pairs(sticky.size());
    for (size_t i = 0; i < sticky.size(); ++i)
      pairs[i] = {sticky[i].data_ptr(), words[i].data_ptr(), words[i].numel(),
                  static_cast<int>(words[i].element_size())};
    ok_or_throw(cuda::keep_first_errors(pairs.data(), static_cast<int>(pairs.size()),
                                        at::cuda::getCurrentCUDAStream().stream()));
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("keep_first_errors", &uniep::torch_glue::keep_first_errors_cuda);
  m.impl("sender_rows", &uniep::torch_glue::sender_rows_cuda);
  m.impl("send_order", &uniep::torch_glue::send_order_cuda);
  m.impl("expert_tiles", &uniep::torch_glue::expert_tiles_cuda);
  m.impl("local_plan", &uniep::torch_glue::local_plan_cuda);
  m.impl("send_rows", &uniep::torch_glue::send_rows_cuda);
  m.impl("combine_rows", &uniep::torch_glue::combine_rows_cuda);
}
