// CUDA implementations of uniep::moe_fused_ep and uniep::moe_fused_ep_backward (schemas in
// registration.cpp): the MegaKernel's forward and backward across the ranks of a group, on the
// group's fused runtime (uniep/cuda/fused_ep.hpp).
// No host sync: the error word and the timeout record come back as tensors, read by the caller
// once the stream has run (uniep.moe.tile_gates.check_send_error / check_gate_timeout).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "torch/common/process_group.hpp"
#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/gemm/grouped.hpp"
#include "torch/megakernel/registry.hpp"
#include "uniep/cuda/fused_ep.hpp"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/tuning.hpp"

namespace uniep::torch_glue {
namespace {

RuntimeRegistry<fused::Runtime>& registry() {
  static auto* r = new RuntimeRegistry<fused::Runtime>(
      "fused MoE runtime",
      "call uniep.moe.megakernel.launch.shutdown_fused_ep(group) first to re-create it",
      "call uniep.moe.megakernel.launch.init_fused_ep(group, ...) on every rank first");
  return *r;
}

// What both directions check of a call on the group's fused runtime, before anything runs: x
// contiguous bf16 on a Hopper GPU with the runtime's hidden size and at most its max_tokens, the
// routing's shapes, the trace against the device's SM count.
struct FusedCall {
  fused::Runtime* rt = nullptr;
  int64_t tokens = 0;
  int device = 0;
  int sms = 0;
};

FusedCall check_fused_call(const at::Tensor& x, const at::Tensor& topk_idx,
                           const at::Tensor& topk_weights, c10::string_view group_name,
                           const std::optional<at::Tensor>& trace) {
  UNIEP_CHECK(x.device().is_cuda(), "x must be a CUDA tensor, got ", x.device());
  UNIEP_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [T, H], got ", x.scalar_type(), " ", x.sizes());
  FusedCall call;
  call.rt = &fused_ep_runtime(std::string(group_name));
  const fused::Config& c = call.rt->config();
  call.tokens = x.size(0);
  UNIEP_CHECK(x.size(1) == c.hidden, "x must be [T, hidden = ", c.hidden, "] (the runtime's), got ",
              x.sizes());
  UNIEP_CHECK(call.tokens <= c.max_tokens, "x has ", call.tokens,
              " tokens, more than the runtime's max_tokens ", c.max_tokens,
              " (re-create it with uniep.moe.megakernel.launch.init_fused_ep)");
  check_exactly(topk_idx, "topk_idx", at::kLong, {call.tokens, c.top_k}, x);
  check_exactly(topk_weights, "topk_weights", at::kFloat, {call.tokens, c.top_k}, x);
  call.device = x.device().index();
  UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(call.device), StatusCode::kUnsupported,
                   "the fused MoE kernel needs a compute capability 9.0 GPU (built for sm_90a)");
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&call.sms, cudaDevAttrMultiProcessorCount, call.device));
  check_trace(trace, call.sms, x);
  return call;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_fused_ep_cuda(
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
    const at::Tensor& w1_packed, const at::Tensor& w2, c10::string_view group_name,
    int64_t comm_ctas, int64_t skip_rounds, const std::optional<at::Tensor>& trace,
    bool w1_as_stored, int64_t tile_n) {
  return translate_errors_on(group_name, [&] {
    const FusedCall call = check_fused_call(x, topk_idx, topk_weights, group_name, trace);
    fused::Runtime& rt = *call.rt;
    const fused::Config& c = rt.config();
    const int64_t T = call.tokens, H = c.hidden, El = c.num_experts / c.world_size;
    check_exactly(w1_packed, "w1_packed", at::kBFloat16, {El, H, 2 * c.ffn}, x);
    check_exactly(w2, "w2", at::kBFloat16, {El, c.ffn, H}, x);
    check_fused_tile_n(tile_n, c.tile_m);
    if (w1_as_stored) check_w1_as_stored(c.ffn, tile_n);
    UNIEP_CHECK(comm_ctas >= 1 && comm_ctas <= (1 << 16), "comm_ctas must be in [1, 65536], got ",
                comm_ctas);
    UNIEP_CHECK(skip_rounds >= -1 && skip_rounds <= (1 << 20),
                "skip_rounds must be -1 (model) or in [0, 2^20], got ", skip_rounds);
    const int device = call.device, device_sms = call.sms;
    const c10::cuda::CUDAGuard guard(x.device());

    const auto opts = x.options();
    at::Tensor out = at::empty({T, H}, opts);
    at::Tensor error = at::zeros({1}, opts.dtype(at::kLong));
    at::Tensor timeout = at::zeros({5}, opts.dtype(at::kInt));
    fused::ForwardArgs f;
    f.x = x.data_ptr();
    f.topk_idx = topk_idx.data_ptr<int64_t>();
    f.topk_weights = topk_weights.data_ptr<float>();
    f.tokens = T;
    f.w1_packed = w1_packed.data_ptr();
    f.w1_as_stored = w1_as_stored;
    f.w2 = w2.data_ptr();
    f.out = out.data_ptr();
    f.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
    f.timeout = reinterpret_cast<cuda::GateTimeout*>(timeout.data_ptr<int32_t>());
    if (trace.has_value()) {
      f.trace = reinterpret_cast<unsigned long long*>(trace->data_ptr<int64_t>());
      if (trace->size(0) >= 6 * device_sms) f.gate_wait_ns = f.trace + 4 * device_sms;
    }
    cuda::FusedMoeLaunch launch;
    launch.comm_ctas = static_cast<int>(comm_ctas);
    launch.skip_rounds = static_cast<int>(skip_rounds);
    launch.tile_n = static_cast<int>(tile_n);
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
    ok_or_throw(rt.forward(f, launch, stream));
    return std::make_tuple(out, error, timeout);
  });
}

// The backward of moe_fused_ep on the same routing (docs/megakernel.md, "The fused backward"):
// the runtime's send of x's and grad_out's rows to their experts' ranks with h and grad_act
// gated on them (backward_rows), the element-wise pass and grad_rows = grad_h w1^T over this
// rank's rows, their return to the sources with the reduce over k (backward_return), then the
// weight gradients. w1 [E / W, H, 2I] (gate columns, then up), w2t [E / W, H, I] = w2
// transposed. Returns grad_x [T, H], grad_w [T, K] fp32, grad_w1, grad_w2, error and timeout.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
moe_fused_ep_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                           const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                           const at::Tensor& w1, const at::Tensor& w2t, c10::string_view group_name,
                           const std::optional<at::Tensor>& trace) {
  return translate_errors_on(group_name, [&] {
    const FusedCall call = check_fused_call(x, topk_idx, topk_weights, group_name, trace);
    fused::Runtime& rt = *call.rt;
    const fused::Config& c = rt.config();
    const int64_t T = call.tokens, H = c.hidden, K = c.top_k, I = c.ffn,
                  El = c.num_experts / c.world_size, C = c.row_capacity();
    UNIEP_CHECK(c.backward, "group '", std::string(group_name),
                "'s fused MoE runtime has no backward buffers: re-create it with "
                "uniep.moe.megakernel.launch.init_fused_ep(..., backward=True)");
    check_exactly(grad_out, "grad_out", at::kBFloat16, {T, H}, x);
    check_exactly(w1, "w1", at::kBFloat16, {El, H, 2 * I}, x);
    check_exactly(w2t, "w2t", at::kBFloat16, {El, H, I}, x);
    const int device = call.device;
    const c10::cuda::CUDAGuard guard(x.device());
    cudaStream_t stream = at::cuda::getCurrentCUDAStream(device).stream();

    const auto opts = x.options();
    at::Tensor h = at::empty({C, 2 * I}, opts);
    at::Tensor grad_act = at::empty({C, I}, opts);
    at::Tensor error = at::zeros({1}, opts.dtype(at::kLong));
    at::Tensor timeout = at::zeros({5}, opts.dtype(at::kInt));
    auto* error_word = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
    auto* timeout_rec = reinterpret_cast<cuda::GateTimeout*>(timeout.data_ptr<int32_t>());
    fused::BackwardArgs b;
    b.x = x.data_ptr();
    b.grad_out = grad_out.data_ptr();
    b.topk_idx = topk_idx.data_ptr<int64_t>();
    b.topk_weights = topk_weights.data_ptr<float>();
    b.tokens = T;
    b.w1 = w1.data_ptr();
    b.w2t = w2t.data_ptr();
    b.h = h.data_ptr();
    b.grad_act = grad_act.data_ptr();
    b.error = error_word;
    b.timeout = timeout_rec;
    if (trace.has_value())
      b.trace = reinterpret_cast<unsigned long long*>(trace->data_ptr<int64_t>());
    fused::BackwardRows rows;
    ok_or_throw(rt.backward_rows(b, &rows, stream));

    // The runtime's buffers, this call's until the next one (stream-ordered before it).
    const at::Tensor rows_x = at::from_blob(const_cast<void*>(rows.rows_x), {C, H}, opts);
    const at::Tensor rows_go = at::from_blob(const_cast<void*>(rows.rows_go), {C, H}, opts);
    const at::Tensor offs =
        at::from_blob(const_cast<int32_t*>(rows.offs), {El}, opts.dtype(at::kInt));
    at::Tensor act_w = at::empty({C, I}, opts);
    at::Tensor grad_h = at::empty({C, 2 * I}, opts);
    at::Tensor dots = at::empty({C}, opts.dtype(at::kFloat));
    // Only the rows in use (offs[E / W - 1] of the capacity), read on the device.
    ok_or_throw(cuda::swiglu_backward_bf16(h.data_ptr(), grad_act.data_ptr(), rows.row_w, C, I,
                                           act_w.data_ptr(), grad_h.data_ptr(),
                                           dots.data_ptr<float>(), stream, rows.offs + El - 1));
    const TuningParams auto_tiles;
    // The buffers hold the most rows a rank can receive; the tiles are chosen for the rows a
    // rank receives on average (every rank's T x K over the W ranks, with balanced batches).
    const int64_t expected_rows = T * K;
    const at::Tensor grad_rows =
        engine_grouped_mm_dgrad(grad_h, w1, offs, auto_tiles, expected_rows);

    at::Tensor grad_x = at::empty({T, H}, opts);
    at::Tensor grad_w = at::empty({T, K}, opts.dtype(at::kFloat));
    fused::ReturnArgs r;
    r.grad_rows = grad_rows.data_ptr();
    r.dots = dots.data_ptr<float>();
    r.tokens = T;
    r.grad_x = grad_x.data_ptr();
    r.grad_w = grad_w.data_ptr<float>();
    r.error = error_word;
    r.timeout = timeout_rec;
    ok_or_throw(rt.backward_return(r, stream));
    // After the return (the peers wait for it, not for these); before this rank's next call.
    at::Tensor grad_w1 = engine_grouped_mm_wgrad(rows_x, grad_h, offs, auto_tiles, expected_rows);
    at::Tensor grad_w2 = engine_grouped_mm_wgrad(act_w, rows_go, offs, auto_tiles, expected_rows);
    return std::make_tuple(grad_x, grad_w, grad_w1, grad_w2, error, timeout);
  });
}

}  // namespace

void fused_ep_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
                     const fused::Config& config) {
  registry().create(group_name, unique_id, config);
}

bool fused_ep_exists(const std::string& group_name) {
  return registry().exists(group_name);
}

void fused_ep_destroy(const std::string& group_name) {
  registry().destroy(group_name);
}

fused::Runtime& fused_ep_runtime(const std::string& group_name) {
  return registry().get(group_name);
}

}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("moe_fused_ep", &uniep::torch_glue::moe_fused_ep_cuda);
  m.impl("moe_fused_ep_backward", &uniep::torch_glue::moe_fused_ep_backward_cuda);
}
