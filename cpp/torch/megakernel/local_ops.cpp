// CUDA implementations of uniep::moe_fused_local, moe_fused_local_planned and
// moe_fused_backward_local (schemas in
// registration.cpp): the MegaKernel's forward (include/uniep/cuda/fused_moe.hpp) and its
// backward's first launch (fused_moe_backward.hpp) at world 1 on torch tensors. Buffers are sized
// by capacity (tokens x top_k rows); no host sync: the error word and the timeout record are
// returned for the caller to read once the stream has run.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/fused_moe_backward.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::torch_glue {
namespace {

// Both ops below. gemm_row, counter, offs and tile_base hold the caller's plan or, with topk_idx
// given, are the buffers the launch plans into (moe_fused_forward_planned_bf16).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_local(
    const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor* topk_idx,
    const at::Tensor& gemm_row, const at::Tensor& counter, const at::Tensor& w1_packed,
    const at::Tensor& w2, const at::Tensor& offs, const at::Tensor& tile_base, int64_t comm_ctas,
    int64_t skip_rounds, double timeout_s, const std::optional<at::Tensor>& trace, int64_t tile_m,
    bool w1_as_stored, int64_t tile_n) {
  UNIEP_CHECK(x.device().is_cuda(), "x must be a CUDA tensor, got ", x.device());
  UNIEP_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [T, H], got ", x.scalar_type(), " ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1);
  UNIEP_CHECK(gemm_row.dim() == 2 && gemm_row.size(0) == T, "gemm_row must be [T = ", T,
              ", K], got ", gemm_row.sizes());
  const int64_t K = gemm_row.size(1);
  UNIEP_CHECK(K >= 1 && K <= 32, "top_k must be in [1, 32], got ", K);
  check_exactly(gemm_row, "gemm_row", at::kLong, {T, K}, x);
  check_exactly(counter, "counter", at::kLong, {T, K}, x);
  check_exactly(topk_weights, "topk_weights", at::kFloat, {T, K}, x);
  UNIEP_CHECK(w1_packed.dim() == 3 && w1_packed.size(1) == H, "w1_packed must be [E, H = ", H,
              ", 2I], got ", w1_packed.sizes());
  const int64_t E = w1_packed.size(0), I = w1_packed.size(2) / 2;
  UNIEP_CHECK(w1_packed.size(2) % 2 == 0, "w1_packed's last dimension (2I) must be even, got ",
              w1_packed.size(2));
  check_exactly(w1_packed, "w1_packed", at::kBFloat16, {E, H, 2 * I}, x);
  check_exactly(w2, "w2", at::kBFloat16, {E, I, H}, x);
  check_exactly(offs, "offs", at::kInt, {E}, x);
  check_exactly(tile_base, "tile_base", at::kInt, {E + 1}, x);
  if (topk_idx != nullptr)
    UNIEP_CHECK(cuda::fused_plan_fits(T * K, E), "moe_fused_local_planned plans at most ",
                cuda::kFusedPlanMaxEntries, " entries (T x K) over at most ",
                cuda::kFusedPlanMaxExperts, " experts in its launch, got ", T * K, " and ", E,
                ": plan with local_plan and call moe_fused_local instead");
  UNIEP_CHECK(H % 64 == 0, "hidden (x.size(1)) must be a multiple of 64, got ", H);
  UNIEP_CHECK(I % 64 == 0, "ffn (w2.size(1)) must be a multiple of 64, got ", I);
  if (w1_as_stored) check_w1_as_stored(I, tile_n);
  UNIEP_CHECK(comm_ctas >= 1 && comm_ctas <= (1 << 16), "comm_ctas must be in [1, 65536], got ",
              comm_ctas);
  UNIEP_CHECK(skip_rounds >= -1 && skip_rounds <= (1 << 20),
              "skip_rounds must be -1 (model) or in [0, 2^20], got ", skip_rounds);
  UNIEP_CHECK(timeout_s >= 0 && timeout_s <= 3600, "timeout_s must be in [0, 3600], got ",
              timeout_s);
  UNIEP_CHECK(tile_m == 128 || tile_m == 64,
              "tile_m must be 128 or 64 (the rows of the fused kernel's tiles, which the plan's "
              "counter and tile_base count), got ",
              tile_m);
  check_fused_tile_n(tile_n, tile_m);
  const int device = x.device().index();
  UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                   "the fused MoE kernel needs a compute capability 9.0 GPU (built for sm_90a)");

  const c10::cuda::CUDAGuard guard(x.device());
  const auto opts = x.options();
  at::Tensor out = at::empty({T, H}, opts);
  if (T == 0)
    return std::make_tuple(out, at::zeros({1}, opts.dtype(at::kLong)),
                           at::zeros({5}, opts.dtype(at::kInt)));
  // The error word, the timeout record and the counters are zeroed by the launch's problem
  // kernel (FusedMoeArgs::zero_state): three fills fewer ahead of it.
  at::Tensor error = at::empty({1}, opts.dtype(at::kLong));
  at::Tensor timeout = at::empty({5}, opts.dtype(at::kInt));
  const int64_t capacity = T * K, num_counters = capacity / tile_m + E + 1;
  at::Tensor rows = at::empty({capacity, H}, opts);
  at::Tensor act = at::empty({capacity, I}, opts);
  at::Tensor y = at::empty({capacity, H}, opts);
  at::Tensor counters = at::empty({3, num_counters}, opts.dtype(at::kInt));
  int device_sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device));
  check_trace(trace, device_sms, x);
  const size_t bytes = cuda::fused_moe_workspace_bytes(E, device_sms);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, opts.dtype(at::kByte));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();

  // The row inverse feeds only the row-order send of fewer senders than SMs (every CTA
  // sending goes token by token): two launches saved at the default point.
  at::Tensor row_entry;
  if (comm_ctas < device_sms) {
    row_entry = at::empty({capacity}, opts.dtype(at::kLong));
    ok_or_throw(cuda::fused_row_entries(gemm_row.data_ptr<int64_t>(), capacity, capacity,
                                        row_entry.data_ptr<int64_t>(), stream));
  }
  cuda::FusedMoeArgs a;
  a.x = x.data_ptr();
  a.tokens = T;
  a.hidden = H;
  a.top_k = K;
  a.topk_weights = topk_weights.data_ptr<float>();
  a.row_entry = row_entry.defined() ? row_entry.data_ptr<int64_t>() : nullptr;
  a.w1_packed = w1_packed.data_ptr();
  a.w1_as_stored = w1_as_stored;
  a.w2 = w2.data_ptr();
  a.num_experts = E;
  a.ffn = I;
  a.capacity = capacity;
  a.rows = rows.data_ptr();
  a.act = act.data_ptr();
  a.y = y.data_ptr();
  a.out = out.data_ptr();
  auto* c = reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>());
  a.counters = c;
  a.done1 = c + num_counters;
  a.done2 = c + 2 * num_counters;
  a.num_counters = num_counters;
  a.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  a.timeout = reinterpret_cast<cuda::GateTimeout*>(timeout.data_ptr<int32_t>());
  a.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  a.zero_state = true;
  if (trace.has_value()) {
    a.trace = reinterpret_cast<unsigned long long*>(trace->data_ptr<int64_t>());
    if (trace->size(0) >= 6 * device_sms) a.gate_wait_ns = a.trace + 4 * device_sms;
    if (trace->size(0) >= 12 * device_sms) a.tile_stamps = a.trace + 6 * device_sms;
  }
  cuda::FusedMoeLaunch launch;
  launch.comm_ctas = static_cast<int>(comm_ctas);
  launch.skip_rounds = static_cast<int>(skip_rounds);
  launch.tile_m = static_cast<int>(tile_m);
  launch.tile_n = static_cast<int>(tile_n);
  if (topk_idx != nullptr) {
    cuda::FusedLocalPlan plan;
    plan.topk_idx = topk_idx->data_ptr<int64_t>();
    plan.gemm_row = gemm_row.data_ptr<int64_t>();
    plan.counter = counter.data_ptr<int64_t>();
    plan.offs = offs.data_ptr<int32_t>();
    plan.tile_base = tile_base.data_ptr<int32_t>();
    ok_or_throw(cuda::moe_fused_forward_planned_bf16(a, plan, launch, device, workspace.data_ptr(),
                                                     bytes, stream));
    return std::make_tuple(out, error, timeout);
  }
  a.gemm_row = gemm_row.data_ptr<int64_t>();
  a.counter = counter.data_ptr<int64_t>();
  a.offs = offs.data_ptr<int32_t>();
  a.tile_base = tile_base.data_ptr<int32_t>();
  ok_or_throw(cuda::moe_fused_forward_bf16(a, launch, device, workspace.data_ptr(), bytes, stream));
  return std::make_tuple(out, error, timeout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_fused_local_cuda(
    const at::Tensor& x, const at::Tensor& topk_weights, const at::Tensor& gemm_row,
    const at::Tensor& counter, const at::Tensor& w1_packed, const at::Tensor& w2,
    const at::Tensor& offs, const at::Tensor& tile_base, int64_t comm_ctas, int64_t skip_rounds,
    double timeout_s, const std::optional<at::Tensor>& trace, int64_t tile_m, bool w1_as_stored,
    int64_t tile_n) {
  return translate_errors([&] {
    return fused_local(x, topk_weights, nullptr, gemm_row, counter, w1_packed, w2, offs, tile_base,
                       comm_ctas, skip_rounds, timeout_s, trace, tile_m, w1_as_stored, tile_n);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_fused_local_planned_cuda(
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
    const at::Tensor& w1_packed, const at::Tensor& w2, double timeout_s, int64_t tile_m,
    bool w1_as_stored, int64_t tile_n) {
  return translate_errors([&] {
    UNIEP_CHECK(x.device().is_cuda() && x.dim() == 2, "x must be a CUDA tensor [T, H], got ",
                x.device(), " ", x.sizes());
    UNIEP_CHECK(topk_idx.dim() == 2 && topk_idx.size(0) == x.size(0),
                "topk_idx must be [T = ", x.size(0), ", K], got ", topk_idx.sizes());
    const int64_t T = x.size(0), K = topk_idx.size(1);
    check_exactly(topk_idx, "topk_idx", at::kLong, {T, K}, x);
    UNIEP_CHECK(w1_packed.dim() == 3, "w1_packed must be [E, H, 2I], got ", w1_packed.sizes());
    const int64_t E = w1_packed.size(0);
    const auto opts = x.options();
    // The plan's buffers, written by the launch.
    at::Tensor gemm_row = at::empty({T, K}, opts.dtype(at::kLong));
    at::Tensor counter = at::empty({T, K}, opts.dtype(at::kLong));
    at::Tensor offs = at::empty({E}, opts.dtype(at::kInt));
    at::Tensor tile_base = at::empty({E + 1}, opts.dtype(at::kInt));
    // Every CTA sends, token by token: the planned launch's one send order.
    constexpr int64_t kEveryCta = 1 << 16;
    return fused_local(x, topk_weights, &topk_idx, gemm_row, counter, w1_packed, w2, offs,
                       tile_base, kEveryCta, -1, timeout_s, std::nullopt, tile_m, w1_as_stored,
                       tile_n);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
moe_fused_backward_local_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                              const at::Tensor& gemm_row, const at::Tensor& counter,
                              const at::Tensor& w1, const at::Tensor& w2t, const at::Tensor& offs,
                              const at::Tensor& tile_base, double timeout_s,
                              const std::optional<at::Tensor>& trace) {
  return translate_errors([&] {
    UNIEP_CHECK(x.device().is_cuda(), "x must be a CUDA tensor, got ", x.device());
    UNIEP_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
                "x must be contiguous bfloat16 [T, H], got ", x.scalar_type(), " ", x.sizes());
    const int64_t T = x.size(0), H = x.size(1);
    check_exactly(grad_out, "grad_out", at::kBFloat16, {T, H}, x);
    UNIEP_CHECK(gemm_row.dim() == 2 && gemm_row.size(0) == T, "gemm_row must be [T = ", T,
                ", K], got ", gemm_row.sizes());
    const int64_t K = gemm_row.size(1);
    UNIEP_CHECK(K >= 1 && K <= 32, "top_k must be in [1, 32], got ", K);
    check_exactly(gemm_row, "gemm_row", at::kLong, {T, K}, x);
    check_exactly(counter, "counter", at::kLong, {T, K}, x);
    UNIEP_CHECK(w1.dim() == 3 && w1.size(1) == H && w1.size(2) % 2 == 0, "w1 must be [E, H = ", H,
                ", 2I], got ", w1.sizes());
    const int64_t E = w1.size(0), I = w1.size(2) / 2;
    check_exactly(w1, "w1", at::kBFloat16, {E, H, 2 * I}, x);
    check_exactly(w2t, "w2t (w2 transposed)", at::kBFloat16, {E, H, I}, x);
    check_exactly(offs, "offs", at::kInt, {E}, x);
    check_exactly(tile_base, "tile_base", at::kInt, {E + 1}, x);
    UNIEP_CHECK(H % 64 == 0, "hidden (x.size(1)) must be a multiple of 64, got ", H);
    UNIEP_CHECK(I % 64 == 0, "ffn (w2t.size(2)) must be a multiple of 64, got ", I);
    UNIEP_CHECK(timeout_s >= 0 && timeout_s <= 3600, "timeout_s must be in [0, 3600], got ",
                timeout_s);
    const int device = x.device().index();
    UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                     "the fused MoE backward needs a compute capability 9.0 GPU (built for "
                     "sm_90a)");

    const c10::cuda::CUDAGuard guard(x.device());
    const auto opts = x.options();
    const int64_t capacity = T * K, num_counters = capacity / cuda::kGatedTileM + E + 1;
    at::Tensor rows_x = at::empty({capacity, H}, opts);
    at::Tensor rows_go = at::empty({capacity, H}, opts);
    at::Tensor h = at::empty({capacity, 2 * I}, opts);
    at::Tensor grad_act = at::empty({capacity, I}, opts);
    at::Tensor error = at::zeros({1}, opts.dtype(at::kLong));
    at::Tensor timeout = at::zeros({5}, opts.dtype(at::kInt));
    if (T == 0) return std::make_tuple(rows_x, rows_go, h, grad_act, error, timeout);
    at::Tensor counters = at::zeros({num_counters}, opts.dtype(at::kInt));
    int device_sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device));
    const size_t bytes = cuda::fused_moe_backward_workspace_bytes(E, device_sms);
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, opts.dtype(at::kByte));
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();

    cuda::FusedBackwardArgs a;
    a.x = x.data_ptr();
    a.grad_out = grad_out.data_ptr();
    a.tokens = T;
    a.hidden = H;
    a.top_k = K;
    a.gemm_row = gemm_row.data_ptr<int64_t>();
    a.counter = counter.data_ptr<int64_t>();
    a.w1 = w1.data_ptr();
    a.w2t = w2t.data_ptr();
    a.num_experts = E;
    a.ffn = I;
    a.offs = offs.data_ptr<int32_t>();
    a.tile_base = tile_base.data_ptr<int32_t>();
    a.capacity = capacity;
    a.rows_x = rows_x.data_ptr();
    a.rows_go = rows_go.data_ptr();
    a.h = h.data_ptr();
    a.grad_act = grad_act.data_ptr();
    a.counters = reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>());
    a.num_counters = num_counters;
    a.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
    a.timeout = reinterpret_cast<cuda::GateTimeout*>(timeout.data_ptr<int32_t>());
    a.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
    if (trace.has_value()) {
      check_trace(trace, device_sms, x);
      a.trace = reinterpret_cast<unsigned long long*>(trace->data_ptr<int64_t>());
    }
    ok_or_throw(cuda::moe_fused_backward_rows_bf16(a, device_sms, device, workspace.data_ptr(),
                                                   bytes, stream));
    return std::make_tuple(rows_x, rows_go, h, grad_act, error, timeout);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("moe_fused_local", &uniep::torch_glue::moe_fused_local_cuda);
  m.impl("moe_fused_local_planned", &uniep::torch_glue::moe_fused_local_planned_cuda);
  m.impl("moe_fused_backward_local", &uniep::torch_glue::moe_fused_backward_local_cuda);
}
