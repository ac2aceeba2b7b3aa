// moe_forward's and moe_backward's world-1 paths (local_layer.hpp).
#include "torch/ep/local_layer.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <tuple>

#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/gemm/fp8_experts.hpp"
#include "torch/gemm/grouped.hpp"
#include "torch/megakernel/local_plan.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/cuda/send_rows.hpp"
#include "uniep/send_rows_error.hpp"
#include "uniep/shape.hpp"

namespace uniep::torch_glue {
namespace {

// The plan's tile counters are the MegaKernel's; only the rows are used here, so any height does.
constexpr int kPlanTileM = 128;
constexpr int kWarpsPerBlock = 8;  // store_token_rows_async's blocks: one warp a token

// An event the host waits on once, destroyed with the call.
class HostWait {
 public:
  explicit HostWait(cudaStream_t stream) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~HostWait() { (void)cudaEventDestroy(event_); }
  HostWait(const HostWait&) = delete;
  HostWait& operator=(const HostWait&) = delete;
  void wait() const { C10_CUDA_CHECK(cudaEventSynchronize(event_)); }

 private:
  cudaEvent_t event_ = nullptr;
};

// The error the plan recorded, as the dispatch words it (cuda::check_routing_layout): the entry
// and its id for an id outside [-1, E), else the plan's own message.
Error plan_error(uint64_t word, const at::Tensor& topk_idx, int64_t num_experts) {
  const int64_t K = topk_idx.size(1);
  if ((word >> kSendErrorShift) != kSendBadExpert) {
    const Status s = send_rows_error_status(word, K, "the world-1 plan");
    return Error(s.code, s.message);
  }
  const int64_t entry = static_cast<int64_t>(word & ((uint64_t{1} << kSendErrorShift) - 1));
  const int64_t id = topk_idx.view(-1)[entry].item<int64_t>();
  return Error(StatusCode::kInvalidArgument,
               bad_expert_id_message(id, entry / K, entry % K, num_experts));
}

// The routing's plan on the device and its error word on its way to the host; check() waits for
// the plan alone and raises what it recorded.
struct LocalPlan {
  at::Tensor offs;      // [E] int32: each expert's row end
  at::Tensor gemm_row;  // [T * K] int64: each entry's GEMM row, -1 unused
  at::Tensor host_error;
  std::unique_ptr<HostWait> planned;

  LocalPlan(const at::Tensor& topk_idx, int64_t num_experts, cudaStream_t stream) {
    const LocalPlanTensors plan = local_plan_on_stream(topk_idx, num_experts, kPlanTileM, stream);
    offs = std::get<1>(plan);
    gemm_row = std::get<4>(plan).view(-1);
    host_error = at::empty({1}, topk_idx.options().device(at::kCPU).pinned_memory(true));
    host_error.copy_(std::get<6>(plan), /*non_blocking=*/true);
    planned = std::make_unique<HostWait>(stream);
  }

  void check(const at::Tensor& topk_idx, int64_t num_experts) const {
    planned->wait();
    if (const auto word = static_cast<uint64_t>(host_error.item<int64_t>()); word != 0)
      throw plan_error(word, topk_idx, num_experts);
  }
};

// Refused before anything is enqueued: a graph cannot hold the host's read of the plan's word.
void refuse_capture(cudaStream_t stream, const char* what) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  UNIEP_CHECK_CODE(capture == cudaStreamCaptureStatusNone, StatusCode::kUnsupported, what,
                   " at world 1 cannot be captured in a CUDA graph: the host reads the routing "
                   "plan's error word after the call; a decode step in a graph runs "
                   "uniep.moe.megakernel.launch.moe_forward_local with check=\"deferred\" or "
                   "uniep.moe.prepared's moe_forward_prepared");
}

int device_sms(const at::Tensor& like) {
  int sms = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, like.device().index()));
  return sms;
}

// src [T, H] stored at each entry's GEMM row of a new [T * K, H] (rows no entry has: untouched).
at::Tensor stored_rows(const at::Tensor& src, const LocalPlan& plan, int64_t top_k, int sms,
                       cudaStream_t stream) {
  const int64_t T = src.size(0), H = src.size(1), n = T * top_k;
  at::Tensor rows = at::empty({n, H}, src.options());
  cuda::StoreRowsArgs s;
  s.x = src.data_ptr();
  s.x_stride = s.row_bytes = H * static_cast<int64_t>(src.element_size());
  s.tokens = T;
  s.top_k = top_k;
  s.gemm_row = plan.gemm_row.data_ptr<int64_t>();
  s.rows = rows.data_ptr();
  s.row_stride = s.row_bytes;
  s.rows_capacity = n;
  const int64_t blocks =
      std::min<int64_t>((T + kWarpsPerBlock - 1) / kWarpsPerBlock, int64_t{sms} * 4);
  ok_or_throw(cuda::store_token_rows_async(s, static_cast<int>(blocks), stream));
  return rows;
}

// The per-k combine of the rows: out[t] = sum_k weights[t, k] y[gemm_row[t, k]] (the plan's word
// covers the rows).
at::Tensor combined(const at::Tensor& y, const LocalPlan& plan, const at::Tensor& weights, int sms,
                    cudaStream_t stream) {
  const int64_t T = weights.size(0), K = weights.size(1), H = y.size(1);
  at::Tensor out = at::empty({T, H}, y.options());
  ok_or_throw(cuda::combine_rows_bf16(y.data_ptr(), y.size(0), plan.gemm_row.data_ptr<int64_t>(),
                                      weights.data_ptr<float>(), T, K, H, out.data_ptr(), nullptr,
                                      sms * 4, stream));
  return out;
}

// What both world-1 paths need: one rank, bf16 x, the engine's GEMMs and the per-k combine.
bool local_engine_call(int64_t world_size, const at::Tensor& x, const TuningParams& params) {
  return world_size == 1 && x.scalar_type() == at::kBFloat16 && params.gemm == GemmEngine::kUniep &&
         params.combine == CombineReduction::kPerChoice;
}

}  // namespace

bool local_layer_takes(int64_t world_size, const at::Tensor& x, const TuningParams& params) {
  return local_engine_call(world_size, x, params) && !params.fp8_experts() &&
         params.dispatch == DispatchPrecision::kBf16;
}

bool local_fp8_forward_takes(int64_t world_size, const at::Tensor& x, const TuningParams& params) {
  return local_engine_call(world_size, x, params) && params.fp8_experts() &&
         params.dispatch == DispatchPrecision::kFp8E4M3;
}

at::Tensor local_moe_forward(const at::Tensor& x, const at::Tensor& topk_idx,
                             const at::Tensor& topk_weights, const at::Tensor& w1,
                             const at::Tensor& w2, const TuningParams& params,
                             cudaStream_t stream) {
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), H = x.size(1);
  const int64_t E = w1.size(0), I = w2.size(1), n = T * K;
  refuse_capture(stream, "moe_forward");
  if (T == 0) return at::empty({0, H}, x.options());
  const LocalPlan plan(topk_idx, E, stream);
  const int sms = device_sms(x);
  const at::Tensor rows = stored_rows(x, plan, K, sms, stream);
  at::Tensor act;
  if (plain_gate_up_ok(w1, params)) {
    act = engine_grouped_mm_swiglu_plain(rows, w1, plan.offs, params);
  } else {
    const at::Tensor h = engine_grouped_mm(rows, w1, plan.offs, params);
    act = at::empty({n, I}, h.options());
    ok_or_throw(cuda::swiglu_bf16(h.data_ptr(), n, I, act.data_ptr(), stream));
  }
  const at::Tensor y = engine_grouped_mm(act, w2, plan.offs, params);
  at::Tensor out = combined(y, plan, topk_weights, sms, stream);
  plan.check(topk_idx, E);
  return out;
}

at::Tensor local_moe_forward_fp8(const at::Tensor& x, const at::Tensor& topk_idx,
                                 const at::Tensor& topk_weights, const at::Tensor& w1,
                                 const at::Tensor& w2, const TuningParams& params,
                                 cudaStream_t stream) {
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), H = x.size(1);
  const int64_t E = w1.size(0), n = T * K;
  refuse_capture(stream, "moe_forward");
  if (T == 0) return at::empty({0, H}, x.options());
  const LocalPlan plan(topk_idx, E, stream);
  // Each token in the fp8 dispatch's encoding (1 x 128 scales), quantized once and stored at its
  // entries' rows; no error word of its own: the rows are the plan's, which its word covers.
  at::Tensor rows = at::empty({n, H}, x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor row_scales = at::empty({n, H / 128}, x.options().dtype(at::kFloat));
  ok_or_throw(cuda::quantize_fp8_rows(x.data_ptr(), T, H, plan.gemm_row.data_ptr<int64_t>(),
                                      static_cast<int>(K), n, rows.data_ptr(),
                                      row_scales.data_ptr<float>(), nullptr, stream));
  const at::Tensor y = fp8_experts_forward(rows, row_scales, plan.offs, w1, w2, params);
  at::Tensor out = combined(y, plan, topk_weights, device_sms(x), stream);
  plan.check(topk_idx, E);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> local_moe_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& topk_idx,
    const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w2,
    const TuningParams& params, cudaStream_t stream) {
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), H = x.size(1);
  const int64_t E = w1.size(0), I = w2.size(1), n = T * K;
  refuse_capture(stream, "moe_backward");
  const auto f32 = x.options().dtype(at::kFloat);
  const at::Tensor row_target = at::arange(n, topk_idx.options());
  if (T == 0)
    return std::make_tuple(at::empty({0, H}, x.options()), at::empty({0}, f32), row_target,
                           at::zeros_like(w1), at::zeros_like(w2));
  const LocalPlan plan(topk_idx, E, stream);
  const int sms = device_sms(x);
  const at::Tensor rows = stored_rows(x, plan, K, sms, stream);
  const at::Tensor go_rows = stored_rows(grad_out.contiguous(), plan, K, sms, stream);
  // Each entry's row, or a spare one past the rows for an unused entry.
  const at::Tensor row_or_spare = at::where(plan.gemm_row >= 0, plan.gemm_row, n);
  // Each row's routing weight.
  const at::Tensor w_row = at::zeros({n + 1}, f32).scatter_(0, row_or_spare, topk_weights.view(-1));
  // As the runtime's path: GEMM 1 recomputed, grad_out's rows through w2^T first (the weight's
  // gradient is <act, that>), the rows past the last expert's end left out of the element-wise
  // pass (live_rows: the last row end).
  const at::Tensor h = engine_grouped_mm(rows, w1, plan.offs, params);
  const at::Tensor grad_act = engine_grouped_mm_dgrad(go_rows, w2, plan.offs, params);
  const at::Tensor act_w = at::empty({n, I}, x.options());
  const at::Tensor grad_h = at::empty_like(h);
  at::Tensor dots = at::zeros({n + 1}, f32);
  ok_or_throw(cuda::swiglu_backward_bf16(
      h.data_ptr(), grad_act.data_ptr(), w_row.data_ptr<float>(), n, I, act_w.data_ptr(),
      grad_h.data_ptr(), dots.data_ptr<float>(), stream, plan.offs.data_ptr<int32_t>() + E - 1));
  const at::Tensor grad_rows = engine_grouped_mm_dgrad(grad_h, w1, plan.offs, params);
  at::Tensor grad_w1 = engine_grouped_mm_wgrad(rows, grad_h, plan.offs, params);
  at::Tensor grad_w2 = engine_grouped_mm_wgrad(act_w, go_rows, plan.offs, params);
  at::Tensor grad_x = combined(grad_rows, plan, at::ones_like(topk_weights), sms, stream);
  // Each entry's dot (0 for an unused one): with row_target the identity, the caller's scatter
  // puts it in its slot.
  at::Tensor entry_dots = dots.index_select(0, row_or_spare);
  plan.check(topk_idx, E);
  return std::make_tuple(grad_x, entry_dots, row_target, grad_w1, grad_w2);
}

}  // namespace uniep::torch_glue
