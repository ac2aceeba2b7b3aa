// CUDA implementations of the expert-parallel ops over the NVSHMEM runtime: ep_dispatch,
// ep_dispatch_cached, ep_combine, moe_forward = dispatch + grouped-GEMM experts (the expert
// GEMM engine, or torch._grouped_mm with tuning gemm=torch) + combine (at world 1 without the
// runtime's round where the numerics allow: local_layer.hpp), and the engine's part of
// moe_backward.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>

#include "cuda/dispatch/expert_rows.hpp"
#include "torch/common/call_checks.hpp"
#include "torch/common/process_group.hpp"
#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/ep/local_layer.hpp"
#include "torch/ep/registry.hpp"
#include "torch/gemm/fp8_experts.hpp"
#include "torch/gemm/grouped.hpp"
#include "uniep/cuda/ep.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/tuning.hpp"

namespace uniep::torch_glue {

namespace {
RuntimeRegistry<ep::Runtime>& registry() {
  static auto* r = new RuntimeRegistry<ep::Runtime>(
      "GPU runtime", "call uniep.moe.ep.shutdown(group) on every rank first to re-create it",
      "call uniep.moe.ep.init_runtime(group, max_tokens=..., hidden=..., top_k=..., "
      "num_experts=...) "
      "on every rank first (moe_forward creates it on first use once uniep is imported)");
  return *r;
}

EpRuntimeFactory& factory_slot() {
  static auto* f = new EpRuntimeFactory();
  return *f;
}

// In the messages of a runtime too small for a call: the call agreement hands them to every
// rank (a peer's quoted), and check_moe_call grows the runtime on seeing it.
constexpr const char* kRuntimeTooSmall = "the group's GPU runtime is too small for this call";
}  // namespace

void set_ep_runtime_factory(EpRuntimeFactory factory) {
  factory_slot() = std::move(factory);
}

std::vector<uint8_t> ep_unique_id() {
  std::vector<uint8_t> id;
  ok_or_throw(ep::make_unique_id(&id));
  return id;
}

void ep_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
               const ep::Config& config) {
  registry().create(group_name, unique_id, config);
}

bool ep_exists(const std::string& group_name) {
  return registry().exists(group_name);
}

void ep_destroy(const std::string& group_name) {
  registry().destroy(group_name);
}

ep::Runtime& ep_runtime(const std::string& group_name) {
  return registry().get(group_name);
}

namespace {

struct Dispatched {
  ep::DispatchCounts counts;
  at::Tensor recv_x, recv_scales, recv_src, recv_topk_idx, recv_topk_weights, tokens_per_expert,
      row_slot, row_target;
  int64_t epoch = 0;
};

void check_routing(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                   const ep::Config& cfg) {
  UNIEP_CHECK(x.dim() == 2, "x must be a 2-D tensor [T, H], got ", x.sizes());
  UNIEP_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", x.device());
  UNIEP_CHECK(x.is_contiguous(), "x must be contiguous");
  // Checked here, before the dispatch starts the round with the peers; the runtime repeats it.
  const int64_t row_bytes = x.size(1) * static_cast<int64_t>(x.element_size());
  UNIEP_CHECK(row_bytes > 0 && row_bytes % 16 == 0 && row_bytes <= cfg.row_bytes_capacity(),
              "x rows must be a multiple of 16 bytes and at most the runtime's row capacity of ",
              cfg.row_bytes_capacity(), " bytes (uniep.moe.ep.init_runtime max_row_bytes), got ",
              x.size(1), " x ", x.element_size(), " = ", row_bytes, " bytes");
  check_topk_idx(topk_idx);
  UNIEP_CHECK(topk_idx.size(0) == x.size(0), "topk_idx must have T = ", x.size(0), " rows like x");
  UNIEP_CHECK(topk_idx.size(1) == cfg.top_k, "topk_idx must have K = ", cfg.top_k,
              " columns (the runtime's top_k), got ", topk_idx.size(1));
  UNIEP_CHECK(topk_idx.device() == x.device(), "topk_idx must be on x's device ", x.device());
  UNIEP_CHECK(topk_weights.sizes() == topk_idx.sizes(),
              "topk_weights must have the shape of topk_idx");
  UNIEP_CHECK(topk_weights.scalar_type() == at::kFloat, "topk_weights must be float32, got ",
              topk_weights.scalar_type());
  UNIEP_CHECK(topk_weights.device() == x.device() && topk_weights.is_contiguous(),
              "topk_weights must be contiguous on x's device");
}

// Whether rows go as fp8, after the dtype check the runtime cannot make (it sees bytes). The
// runtime's begin_* check the rest of the tuning before anything is enqueued.
bool check_dispatch_precision(const at::Tensor& x, const TuningParams& params) {
  const bool fp8 = params.dispatch == DispatchPrecision::kFp8E4M3;
  UNIEP_CHECK(!fp8 || x.scalar_type() == at::kBFloat16,
              "x must be bfloat16 for tuning dispatch=fp8, got ", x.scalar_type());
  return fp8;
}

// The received rows (x's dtype, or e4m3 with fp8) and their fp8 block scales ([0, 0] if bf16).
std::pair<at::Tensor, at::Tensor> empty_received(const at::Tensor& x, int64_t rows, bool fp8) {
  const int64_t H = x.size(1);
  return {at::empty({rows, H}, fp8 ? x.options().dtype(at::kFloat8_e4m3fn) : x.options()),
          at::empty({fp8 ? rows : 0, fp8 ? H / 128 : 0}, x.options().dtype(at::kFloat))};
}

// Runs a raw dispatch's own checks (`check` returns its tuning); when one fails, this rank
// still takes part in the round's exchange (Runtime::fail_round), so that its peers fail at once
// naming it instead of waiting for its counts until their timeout, then rethrows.
template <typename Check>
TuningParams checked_or_failed_round(ep::Runtime& rt, bool cached, cudaStream_t stream,
                                     Check check) {
  try {
    return check();
  } catch (const Error&) {
    (void)rt.fail_round(cached, stream);
    throw;
  }
}

ep::DispatchInput dispatch_input(const at::Tensor& x, const at::Tensor& topk_idx,
                                 const at::Tensor& topk_weights, const TuningParams& params,
                                 bool fp8) {
  return {x.data_ptr(),
          x.size(1) * static_cast<int64_t>(x.element_size()),
          topk_idx.data_ptr<int64_t>(),
          topk_weights.data_ptr<float>(),
          x.size(0),
          params.comm_sms,
          fp8,
          params.combine};
}

// The caller has run check_routing and check_dispatch_precision (inside the checks its peers
// agree on, so they are not repeated on this path).
Dispatched run_dispatch(const at::Tensor& x, const at::Tensor& topk_idx,
                        const at::Tensor& topk_weights, ep::Runtime& rt, const TuningParams& params,
                        bool copy_rows, cudaStream_t stream) {
  const ep::Config& cfg = rt.config();
  const bool fp8 = params.dispatch == DispatchPrecision::kFp8E4M3;
  Dispatched d;
  // The rows are on their way while the outputs below are allocated.
  ok_or_throw(
      rt.begin_dispatch(dispatch_input(x, topk_idx, topk_weights, params, fp8), stream, &d.counts));
  const int64_t N = d.counts.num_recv, K = cfg.top_k;
  const int64_t R =
      std::accumulate(d.counts.rows_per_expert.begin(), d.counts.rows_per_expert.end(), int64_t{0});
  const auto i64 = x.options().dtype(at::kLong);
  // Without copy_rows the rows stay in the runtime's buffer: no recv_x (nor its scales).
  std::tie(d.recv_x, d.recv_scales) = empty_received(x, copy_rows ? N : 0, fp8);
  d.recv_src = at::empty({N}, i64);
  d.recv_topk_idx = at::empty({N, K}, i64);
  d.recv_topk_weights = at::empty({N, K}, x.options().dtype(at::kFloat));
  d.row_slot = at::empty({R}, i64);
  d.row_target = at::empty({R}, i64);
  d.epoch = static_cast<int64_t>(rt.epoch());
  ep::DispatchOutput out;
  out.recv_x = copy_rows ? d.recv_x.data_ptr() : nullptr;
  out.recv_scales = fp8 && copy_rows ? d.recv_scales.data_ptr<float>() : nullptr;
  out.recv_src = d.recv_src.data_ptr<int64_t>();
  out.recv_topk_idx = d.recv_topk_idx.data_ptr<int64_t>();
  out.recv_topk_weights = d.recv_topk_weights.data_ptr<float>();
  out.row_slot = d.row_slot.data_ptr<int64_t>();
  out.row_target = d.row_target.data_ptr<int64_t>();
  ok_or_throw(rt.end_dispatch(out, stream));
  // Device-to-device from the runtime's plan: no pageable host copy on the critical path.
  // Without copy_rows the caller (moe_forward, moe_backward) reads the counts in stream order
  // before any later dispatch can rewrite them: a view, not a copy (the copy's driver call
  // cost the host ~25 us while the GPU, drained by the count read, waited).
  const int64_t El = static_cast<int64_t>(d.counts.rows_per_expert.size());
  d.tokens_per_expert = at::from_blob(const_cast<int64_t*>(rt.rows_per_local_expert()), {El}, i64);
  if (copy_rows) d.tokens_per_expert = d.tokens_per_expert.clone();
  return d;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor, int64_t>
ep_dispatch_cuda(const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                 c10::string_view group_name, c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const c10::cuda::CUDAGuard guard(x.device());
    ep::Runtime& rt = ep_runtime(std::string(group_name));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
    const TuningParams params = checked_or_failed_round(rt, false, stream, [&] {
      const TuningParams p = TuningParams::parse(std::string(tuning));
      check_routing(x, topk_idx, topk_weights, rt.config());
      check_dispatch_precision(x, p);
      return p;
    });
    Dispatched d = run_dispatch(x, topk_idx, topk_weights, rt, params, true, stream);
    return std::make_tuple(d.recv_x, d.recv_scales, d.recv_src, d.recv_topk_idx,
                           d.recv_topk_weights, d.tokens_per_expert, d.row_slot, d.row_target,
                           d.epoch);
  });
}

// A dispatch on the plan of an earlier one (its handle's epoch): the same routing, other rows.
// No layout, count exchange or host sync; the rows land in the plan's slots.
std::tuple<at::Tensor, at::Tensor, int64_t> ep_dispatch_cached_cuda(
    const at::Tensor& x, const at::Tensor& topk_idx, const at::Tensor& topk_weights,
    c10::string_view group_name, int64_t epoch, c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const c10::cuda::CUDAGuard guard(x.device());
    ep::Runtime& rt = ep_runtime(std::string(group_name));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
    const TuningParams params = checked_or_failed_round(rt, true, stream, [&] {
      const TuningParams p = TuningParams::parse(std::string(tuning));
      check_routing(x, topk_idx, topk_weights, rt.config());
      check_dispatch_precision(x, p);
      UNIEP_CHECK(epoch >= 0, "epoch must be a handle's epoch (>= 0), got ", epoch);
      return p;
    });
    const bool fp8 = params.dispatch == DispatchPrecision::kFp8E4M3;
    ep::DispatchCounts counts;
    ok_or_throw(rt.begin_cached_dispatch(static_cast<uint64_t>(epoch),
                                         dispatch_input(x, topk_idx, topk_weights, params, fp8),
                                         stream, &counts));
    const auto [recv_x, recv_scales] = empty_received(x, counts.num_recv, fp8);
    ep::DispatchOutput out;
    out.recv_x = recv_x.data_ptr();
    out.recv_scales = fp8 ? recv_scales.data_ptr<float>() : nullptr;
    ok_or_throw(rt.end_dispatch(out, stream));
    return std::make_tuple(recv_x, recv_scales, static_cast<int64_t>(rt.epoch()));
  });
}

// The per-(token, k) combine runs after the experts, alone on the stream: it has nothing to
// overlap with, so it takes the SMs of the whole budget (sms's total; all of the device by
// default), as combine=rank_partials always has. sms's first number bounds communication where
// it runs beside compute (the dispatch's roles, the MegaKernel). Measured on one H100 with 24
// SMs: the send copied a DeepSeek-V3 rank's rows at 1.4 TB/s, 0.69 ms of a 6 ms layer
// (2026-11-25, the tree just after commit cf3d04d).
int combine_sms(const TuningParams& params, const at::Tensor& like) {
  int device_sms = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, like.device().index()));
  return params.total_sms > 0 ? std::min(params.total_sms, device_sms) : device_sms;
}

at::Tensor run_combine(const at::Tensor& y, const at::Tensor& row_target,
                       const at::Tensor& topk_idx, const at::Tensor& topk_weights, ep::Runtime& rt,
                       int64_t epoch, const TuningParams& params, cudaStream_t stream) {
  const ep::Config& cfg = rt.config();
  UNIEP_CHECK(y.dim() == 2 && y.size(1) == cfg.hidden, "y must be [R, H = ", cfg.hidden, "], got ",
              y.sizes());
  const bool y_fp32 = y.scalar_type() == at::kFloat;
  UNIEP_CHECK(y.scalar_type() == at::kBFloat16 ||
                  (y_fp32 && params.combine == CombineReduction::kRankPartials),
              "y must be bfloat16 (or float32 with combine=rank_partials, which sums the rows "
              "unrounded), got ",
              y.scalar_type(), " with combine=", combine_reduction_name(params.combine));
  UNIEP_CHECK(y.is_cuda() && y.is_contiguous(), "y must be a contiguous CUDA tensor");
  UNIEP_CHECK(row_target.dim() == 1 && row_target.size(0) == y.size(0) &&
                  row_target.scalar_type() == at::kLong,
              "row_target must be int64 [R] with R = y.size(0) = ", y.size(0));
  check_topk_idx(topk_idx);
  UNIEP_CHECK(topk_weights.sizes() == topk_idx.sizes() &&
                  topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                  topk_weights.device() == y.device(),
              "topk_weights must be contiguous float32 shaped like topk_idx on y's device");
  at::Tensor out = at::empty({topk_idx.size(0), cfg.hidden}, y.options().dtype(at::kBFloat16));
  ok_or_throw(rt.combine(y.data_ptr(), row_target.data_ptr<int64_t>(), y.size(0),
                         topk_idx.data_ptr<int64_t>(), topk_weights.data_ptr<float>(),
                         topk_idx.size(0), combine_sms(params, y), params.combine, out.data_ptr(),
                         static_cast<uint64_t>(epoch), stream, y_fp32));
  return out;
}

at::Tensor ep_combine_cuda(const at::Tensor& y, const at::Tensor& row_target,
                           const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                           c10::string_view group_name, int64_t epoch, c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const TuningParams params = TuningParams::parse(std::string(tuning));
    const c10::cuda::CUDAGuard guard(y.device());
    ep::Runtime& rt = ep_runtime(std::string(group_name));
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(y.device().index());
    return run_combine(y, row_target, topk_idx, topk_weights, rt, epoch, params, stream);
  });
}

// moe_forward's and moe_backward's checks, all of them before the dispatch's count exchange
// and shared with the peers: a bad argument on one rank is the same error on all of them, not a
// timeout in the exchange.
struct CheckedMoeCall {
  TuningParams params;
  ep::Runtime* runtime = nullptr;
  MoeInputs in;
};

CheckedMoeCall check_moe_call_once(CallKind kind, const Group& group, const at::Tensor* grad_out,
                                   const at::Tensor& x, const at::Tensor& topk_idx,
                                   const at::Tensor& topk_weights, const at::Tensor& w1,
                                   const at::Tensor& w2, c10::string_view group_name,
                                   c10::string_view tuning) {
  CheckedMoeCall c;
  check_and_agree(group, kind, x.device(), [&] {
    c.params = TuningParams::parse(std::string(tuning));
    c.runtime = &ep_runtime(std::string(group_name));
    const ep::Config& cfg = c.runtime->config();
    c.in = validate_moe_inputs(x, topk_idx, topk_weights, w1, w2, cfg.world_size, cfg.rank,
                               Executor::kCuda);
    UNIEP_CHECK_CODE(x.scalar_type() == at::kBFloat16, StatusCode::kUnsupported,
                     "the CUDA executor takes bfloat16 x (its expert GEMMs are bf16), got ",
                     x.scalar_type());
    if (kind == CallKind::kMoeForward) {
      // The backward differentiates the bf16 layer (TuningParams::experts): no fp8 GEMM there.
      check_expert_precision(c.params, c.in.shape.hidden, c.in.shape.ffn_hidden);
      UNIEP_CHECK(!c.params.fp8_experts() || c.params.gemm == GemmEngine::kUniep,
                  "tuning gemm=torch has no fp8 expert GEMM, and dispatch=fp8 runs the experts "
                  "in fp8: add experts=bf16 (bf16 GEMMs on the fp8 rows) or drop gemm=torch");
    }
    if (c.params.gemm == GemmEngine::kUniep) {
      // The engine's TMA moves 16-byte rows of every operand; torch._grouped_mm takes any size.
      UNIEP_CHECK_CODE(c.in.shape.ffn_hidden % 8 == 0, StatusCode::kUnsupported,
                       "w2.size(1) (the expert FFN size) must be a multiple of 8 for the expert "
                       "GEMM engine, got ",
                       c.in.shape.ffn_hidden, " (tuning gemm=torch takes any size)");
      UNIEP_CHECK_CODE(c.in.shape.hidden % 8 == 0, StatusCode::kUnsupported,
                       "x.size(1) (hidden) must be a multiple of 8 for the expert GEMM engine, "
                       "got ",
                       c.in.shape.hidden, " (tuning gemm=torch takes any size)");
      UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(x.device().index()), StatusCode::kUnsupported,
                       "the expert GEMM engine needs a compute capability 9.0 GPU (it is built "
                       "for sm_90a); tuning gemm=torch runs torch._grouped_mm instead");
      // A tile request that no compiled configuration has is an error on every rank alike (fp8
      // experts pick among the fp8 GEMM's).
      const cuda::GroupedGemmTiles want{c.params.tile_m, c.params.tile_n, c.params.tile_k,
                                        c.params.stages, c.params.cluster};
      int index = 0;
      if (kind == CallKind::kMoeForward && c.params.fp8_experts()) {
        // The first fp8 GEMM has the SwiGLU epilogue (fp8_experts_forward), which the swapped
        // tiles lack: refused here, before any transfer, rather than by that GEMM mid-call.
        cuda::GroupedGemmFp8Problem probe;
        probe.num_experts = 1;
        probe.swiglu = true;
        ok_or_throw(cuda::grouped_gemm_fp8_select(probe, want, &index));
      } else {
        cuda::GroupedGemmProblem probe;
        probe.num_experts = 1;
        ok_or_throw(cuda::grouped_gemm_select(probe, want, &index));
      }
    }
    UNIEP_CHECK(c.in.shape.num_experts == cfg.num_experts && c.in.shape.hidden == cfg.hidden &&
                    c.in.shape.top_k == cfg.top_k,
                "w1/x/topk_idx describe ", c.in.shape.num_experts, " experts of hidden ",
                c.in.shape.hidden, ", top_k ", c.in.shape.top_k, ": ", kRuntimeTooSmall,
                " (created for ", cfg.num_experts, ", ", cfg.hidden, ", ", cfg.top_k, ")");
    check_routing(x, topk_idx, topk_weights, cfg);
    const bool fp8 = check_dispatch_precision(x, c.params);
    ok_or_throw(c.runtime->check_dispatch_args(x.size(1) * static_cast<int64_t>(x.element_size()),
                                               c.params.comm_sms, fp8));
    UNIEP_CHECK_CODE(x.size(0) <= cfg.max_tokens, StatusCode::kCapacityExceeded, "x has ",
                     x.size(0), " tokens: ", kRuntimeTooSmall, " (it holds at most ",
                     cfg.max_tokens, " per rank, max_tokens of uniep.moe.ep.init_runtime)");
    if (grad_out != nullptr) check_like(*grad_out, "grad_out", x, "x");
    return moe_signature(kind, c.in.dtype, c.in.weight_dtype, c.in.shape, c.params);
  });
  return c;
}

// The checks of check_moe_call_once on the group's runtime, created first if the group has none
// and re-created larger if the agreed checks found it too small on any rank. Both are collective
// and safe: runtimes are created and destroyed on every rank together, so a missing one is
// missing everywhere; and the agreement gives every rank the too-small verdict in the same call,
// before any transfer, so every rank grows it here, in step, then checks again once.
CheckedMoeCall check_moe_call(CallKind kind, const at::Tensor* grad_out, const at::Tensor& x,
                              const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                              const at::Tensor& w1, const at::Tensor& w2,
                              c10::string_view group_name, c10::string_view tuning) {
  const std::string name(group_name);
  const Group group = resolve_group(name);
  const EpRuntimeFactory& make = factory_slot();
  // The sizes the factory needs; malformed shapes are left to the checks, which name them.
  const bool shaped = make && x.dim() == 2 && topk_idx.dim() == 2 && w1.dim() == 3;
  const auto make_for_call = [&] {
    make(name, x.size(0), x.size(1), topk_idx.size(1), w1.size(0) * group.world_size);
  };
  if (shaped && !ep_exists(name)) make_for_call();
  try {
    return check_moe_call_once(kind, group, grad_out, x, topk_idx, topk_weights, w1, w2, group_name,
                               tuning);
  } catch (const Error& e) {
    if (!shaped || std::string(e.what()).find(kRuntimeTooSmall) == std::string::npos) throw;
  }
  make_for_call();
  return check_moe_call_once(kind, group, grad_out, x, topk_idx, topk_weights, w1, w2, group_name,
                             tuning);
}

// moe_backward on CUDA is composed in Python (uniep/moe/backward_cuda.py) from the runtime's
// ops; it calls this first, for the checks and the agreement moe_forward makes.
void moe_backward_checks_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                              const at::Tensor& topk_idx, const at::Tensor& topk_weights,
                              const at::Tensor& w1, const at::Tensor& w2,
                              c10::string_view group_name, c10::string_view tuning) {
  translate_errors_on(group_name, [&] {
    check_moe_call(CallKind::kMoeBackward, &grad_out, x, topk_idx, topk_weights, w1, w2, group_name,
                   tuning);
  });
}

// dst[r] = the row of slot row_slot[r] in src (slot s at src + s * stride bytes), cols bf16
// each (the fp8 rows as bf16 pairs): each slot's row read once and stored to its rows (at most
// top-k of them).
void gather_slot_rows(const void* src, int64_t stride, const ep::Runtime& rt, const Dispatched& d,
                      int64_t cols, void* dst, const at::Tensor& like, cudaStream_t stream) {
  const ep::Config& cfg = rt.config();
  const int64_t N = d.counts.num_recv, R = d.row_slot.size(0);
  const auto* row_slot = d.row_slot.data_ptr<int64_t>();
  if (cfg.top_k > 32 || N == 0 || R == 0) {
    ok_or_throw(cuda::gather_rows_bf16(src, stride, N, row_slot, R, cols, dst, stream));
    return;
  }
  const int per_slot = static_cast<int>(cfg.top_k);
  const size_t bytes = cuda::gather_rows_workspace_bytes(N, per_slot);
  // The caching allocator's blocks are 512-byte aligned, more than the 16 the lists need.
  const at::Tensor ws = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  ok_or_throw(cuda::gather_rows_bf16(src, stride, N, row_slot, R, cols, per_slot, ws.data_ptr(),
                                     bytes, dst, stream));
}

// gather_slot_rows from the runtime's receive buffer.
void gather_received_rows(const ep::Runtime& rt, const Dispatched& d, int64_t cols, void* dst,
                          const at::Tensor& like, cudaStream_t stream) {
  gather_slot_rows(rt.received_rows(), rt.config().row_bytes_capacity(), rt, d, cols, dst, like,
                   stream);
}

// The fp8 rows of a dispatch run without copy_rows as the fp8 GEMM takes them: e4m3 [R, H] and
// their 1 x 128 block scales [R, H / 128], gathered in the plan's row order.
std::pair<at::Tensor, at::Tensor> gathered_fp8_rows(const at::Tensor& x, const Dispatched& d,
                                                    const ep::Runtime& rt, cudaStream_t stream) {
  const ep::Config& cfg = rt.config();
  const int64_t N = d.counts.num_recv, H = cfg.hidden, R = d.row_slot.size(0);
  const int64_t cap = cfg.row_bytes_capacity(), blocks = H / 128;
  // The e4m3 bytes in one launch, moved as bf16 pairs (H is a multiple of 128); gathering whole
  // records and then narrowing them moved each byte three times (0.4 ms of a DeepSeek-V3 EP8
  // rank's layer on an H200).
  at::Tensor q = at::empty({R, H}, x.options().dtype(at::kFloat8_e4m3fn));
  gather_received_rows(rt, d, H / 2, q.data_ptr(), x, stream);
  if (blocks % 4 == 0 && cap % 16 == 0 && N > 0) {
    // The scales too in one launch of ours (16-byte pieces: four scales), instead of
    // index_select on a strided view: 22 us on the GPU, and 55-95 us of host time while the
    // GPU had only the gather queued (DeepSeek-V3 EP8 rank; traces on one H200, 2026-11-28,
    // commit daa9d57).
    at::Tensor scales = at::empty({R, blocks}, x.options().dtype(at::kFloat));
    ok_or_throw(cuda::gather_rows_bf16(static_cast<const uint8_t*>(rt.received_rows()) + H, cap, N,
                                       d.row_slot.data_ptr<int64_t>(), R, blocks * 2,
                                       scales.data_ptr(), stream));
    return {q, scales};
  }
  const at::Tensor scales =
      at::from_blob(const_cast<void*>(rt.received_rows()), {N, cap}, x.options().dtype(at::kByte))
          .narrow(1, H, blocks * 4)
          .view(at::kFloat)
          .index_select(0, d.row_slot);
  return {q, scales};
}

// The experts' rows of a dispatch run without copy_rows: gathered in the plan's row order
// straight from the runtime's symmetric buffer (fp8 rows dequantized as the CPU executor does
// for bf16 experts: fp32 product of the e4m3 value and its block scale, rounded once to bf16).
at::Tensor gathered_rows(const at::Tensor& x, const Dispatched& d, const ep::Runtime& rt,
                         const TuningParams& params, cudaStream_t stream) {
  const int64_t H = rt.config().hidden, R = d.row_slot.size(0);
  if (params.dispatch == DispatchPrecision::kFp8E4M3) {
    const int64_t blocks = H / 128;
    const auto [q, scales] = gathered_fp8_rows(x, d, rt, stream);
    return (q.to(at::kFloat).view({R, blocks, 128}) * scales.unsqueeze(2))
        .view({R, H})
        .to(at::kBFloat16);
  }
  // Straight from the receive slots (index_select on the strided view cost ~0.1 ms of host
  // time while the GPU, drained by the count sync, waited for work).
  at::Tensor xs = at::empty({R, H}, x.options().dtype(at::kBFloat16));
  gather_received_rows(rt, d, H, xs.data_ptr(), x, stream);
  return xs;
}

// The grouped GEMMs' offs: each local expert's cumulative row end, int32 on the device.
at::Tensor expert_offs(const Dispatched& d, const at::Tensor& x, cudaStream_t stream) {
  at::Tensor offs = at::empty({d.tokens_per_expert.size(0)}, x.options().dtype(at::kInt));
  ok_or_throw(cuda::expert_offsets(d.tokens_per_expert.data_ptr<int64_t>(), offs.size(0),
                                   offs.data_ptr<int32_t>(), stream));
  return offs;
}

at::Tensor moe_forward_cuda(const at::Tensor& x, const at::Tensor& topk_idx,
                            const at::Tensor& topk_weights, const at::Tensor& w1,
                            const at::Tensor& w2, c10::string_view group_name,
                            c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const CheckedMoeCall c = check_moe_call(CallKind::kMoeForward, nullptr, x, topk_idx,
                                            topk_weights, w1, w2, group_name, tuning);
    const TuningParams& params = c.params;
    const MoeInputs& in = c.in;
    ep::Runtime& rt = *c.runtime;
    const ep::Config& cfg = rt.config();
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
    if (local_layer_takes(cfg.world_size, x, params))
      return local_moe_forward(x, topk_idx, topk_weights, w1, w2, params, stream);
    if (local_fp8_forward_takes(cfg.world_size, x, params))
      return local_moe_forward_fp8(x, topk_idx, topk_weights, w1, w2, params, stream);
    Dispatched d = run_dispatch(x, topk_idx, topk_weights, rt, params, false, stream);
    const int64_t H = cfg.hidden, I = in.shape.ffn_hidden;
    const int64_t R = d.row_slot.size(0);
    // combine=rank_partials sums the second GEMM's outputs as accumulated (fp32): the partial's
    // one rounding replaces the rows' own, as in the CPU executor.
    const bool y_f32 = params.combine == CombineReduction::kRankPartials;
    at::Tensor y;
    if (R == 0) {
      y = at::empty({0, H}, x.options().dtype(y_f32 ? at::kFloat : at::kBFloat16));
    } else if (params.fp8_experts()) {
      // The rows stay in the dispatch's e4m3 for the first fp8 GEMM (torch/gemm/fp8_experts.hpp).
      const auto [rows, row_scales] = gathered_fp8_rows(x, d, rt, stream);
      y = fp8_experts_forward(rows, row_scales, expert_offs(d, x, stream), w1, w2, params, y_f32);
    } else {
      const at::Tensor xs = gathered_rows(x, d, rt, params, stream);
      const at::Tensor offs = expert_offs(d, x, stream);
      auto grouped = [&](const at::Tensor& a, const at::Tensor& w) {
        return params.gemm == GemmEngine::kUniep ? engine_grouped_mm(a, w, offs, params)
                                                 : at::_grouped_mm(a, w, offs);
      };
      at::Tensor act;
      if (params.gemm == GemmEngine::kUniep && plain_gate_up_ok(w1, params)) {
        // SwiGLU in the first GEMM's epilogue, w1 read as stored: h never reaches memory.
        act = engine_grouped_mm_swiglu_plain(xs, w1, offs, params);
      } else if (params.gemm == GemmEngine::kUniep) {
        // One pass over h, silu(g) * u rounded once (the SwiGLU epilogue's formula, the bits
        // of the branch above).
        const at::Tensor h = grouped(xs, w1);
        act = at::empty({R, I}, h.options());
        ok_or_throw(cuda::swiglu_bf16(h.data_ptr(), R, I, act.data_ptr(), stream));
      } else {
        const at::Tensor h = grouped(xs, w1);
        act = at::silu(h.narrow(1, 0, I)) * h.narrow(1, I, I);
      }
      if (!y_f32)
        y = grouped(act, w2).contiguous();
      else if (params.gemm == GemmEngine::kUniep)
        y = engine_grouped_mm_f32(act, w2, offs, params);
      else  // torch._grouped_mm stores its inputs' dtype: the product of fp32 copies
        y = at::_grouped_mm(act.to(at::kFloat), w2.to(at::kFloat), offs);
    }
    return run_combine(y, d.row_target, topk_idx, topk_weights, rt, d.epoch, params, stream);
  });
}

// moe_backward's dispatches, expert GEMMs and combine on the engine (tuning gemm=uniep), one
// op so that nothing but the dispatch's count read waits between the launches (composed in
// Python, the host's op overhead left the GPU idle for ~20% of a small layer's backward). The
// forward's rows are dispatched again (same routing: same slots and rows) and gathered from the
// symmetric buffer before grad_out rides on that plan (the cached round's barrier keeps the
// peers' rows out of the buffer until this rank has passed the gather). Returns grad_x (the
// combine of the rows' input gradients with unit weights), each row's <act, grad_out w2^T>
// (the routing weight's gradient, by row: uniep/moe/ep.py's _rows_to_slots takes it back to the
// slot), the rows' combine targets, and the weights' gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward_engine_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& topk_idx,
    const at::Tensor& topk_weights, const at::Tensor& w1, const at::Tensor& w2,
    c10::string_view group_name, c10::string_view tuning) {
  return translate_errors_on(group_name, [&] {
    const CheckedMoeCall c = check_moe_call(CallKind::kMoeBackward, &grad_out, x, topk_idx,
                                            topk_weights, w1, w2, group_name, tuning);
    const TuningParams& params = c.params;
    UNIEP_CHECK(params.gemm == GemmEngine::kUniep,
                "moe_backward_engine runs the expert GEMM engine (tuning gemm=uniep), got "
                "gemm=torch (uniep/moe/ep.py composes that path)");
    ep::Runtime& rt = *c.runtime;
    const c10::cuda::CUDAGuard guard(x.device());
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
    if (local_layer_takes(rt.config().world_size, x, params))
      return local_moe_backward(grad_out, x, topk_idx, topk_weights, w1, w2, params, stream);
    const int64_t K = rt.config().top_k, H = rt.config().hidden, I = c.in.shape.ffn_hidden;
    const Dispatched d = run_dispatch(x, topk_idx, topk_weights, rt, params, false, stream);
    const int64_t R = d.row_slot.size(0);
    const at::Tensor rows = gathered_rows(x, d, rt, params, stream);
    // Each row's routing weight, from the received (token, k) weights.
    const at::Tensor w_row = at::empty({R}, x.options().dtype(at::kFloat));
    cuda::launch_row_weights(d.recv_topk_weights.data_ptr<float>(), d.row_slot.data_ptr<int64_t>(),
                             d.row_target.data_ptr<int64_t>(), R, K, w_row.data_ptr<float>(),
                             stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();

    // grad_out travels in bf16 whatever the forward's precision, summed with unit weights.
    TuningParams grad_params = params;
    grad_params.dispatch = DispatchPrecision::kBf16;
    grad_params.combine = CombineReduction::kPerChoice;
    const at::Tensor go = grad_out.contiguous();
    ep::DispatchCounts counts;
    ok_or_throw(rt.begin_cached_dispatch(
        static_cast<uint64_t>(d.epoch),
        dispatch_input(go, topk_idx, topk_weights, grad_params, false), stream, &counts));
    // A cached round writes its rows out (the runtime keeps its buffer for rows a caller reads).
    const at::Tensor recv_go = at::empty({counts.num_recv, H}, go.options());
    ep::DispatchOutput go_out;
    go_out.recv_x = recv_go.data_ptr();
    ok_or_throw(rt.end_dispatch(go_out, stream));
    const int64_t back_epoch = static_cast<int64_t>(rt.epoch());
    // Each slot's grad_out row read once (index_select: ~50 us more host time on the path). The
    // gather reads d's slots from recv_go, so the cached round must have received as many.
    UNIEP_CHECK_CODE(counts.num_recv == d.counts.num_recv, StatusCode::kInternal,
                     "moe_backward: grad_out's cached round received ", counts.num_recv,
                     " rows where the forward's plan has ", d.counts.num_recv);
    const at::Tensor go_rows = at::empty({R, H}, go.options());
    gather_slot_rows(recv_go.data_ptr(), H * recv_go.element_size(), rt, d, H, go_rows.data_ptr(),
                     go, stream);

    at::Tensor grad_rows, dots, grad_w1, grad_w2;
    if (R == 0) {
      grad_rows = at::empty({0, H}, x.options());
      dots = at::empty({0}, x.options().dtype(at::kFloat));
      grad_w1 = at::zeros_like(w1);
      grad_w2 = at::zeros_like(w2);
    } else {
      const at::Tensor offs = expert_offs(d, x, stream);
      // GEMM 1 recomputed; grad_out's rows before the weight through w2^T, so the weight's
      // gradient is <act, that> and y = act w2 is never recomputed (docs/expert_gemm.md).
      const at::Tensor h = engine_grouped_mm(rows, w1, offs, params);
      const at::Tensor grad_act = engine_grouped_mm_dgrad(go_rows, w2, offs, params);
      const at::Tensor act_w = at::empty({R, I}, x.options());
      const at::Tensor grad_h = at::empty_like(h);
      dots = at::empty({R}, x.options().dtype(at::kFloat));
      ok_or_throw(cuda::swiglu_backward_bf16(h.data_ptr(), grad_act.data_ptr(),
                                             w_row.data_ptr<float>(), R, I, act_w.data_ptr(),
                                             grad_h.data_ptr(), dots.data_ptr<float>(), stream));
      grad_rows = engine_grouped_mm_dgrad(grad_h, w1, offs, params);
      grad_w1 = engine_grouped_mm_wgrad(rows, grad_h, offs, params);
      grad_w2 = engine_grouped_mm_wgrad(act_w, go_rows, offs, params);
    }
    const at::Tensor ones = at::ones_like(topk_weights);
    at::Tensor grad_x = run_combine(grad_rows.contiguous(), d.row_target, topk_idx, ones, rt,
                                    back_epoch, grad_params, stream);
    return std::make_tuple(grad_x, dots, d.row_target, grad_w1, grad_w2);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> ll_dispatch_cuda(const at::Tensor& x,
                                                                const at::Tensor& topk_idx,
                                                                c10::string_view group_name,
                                                                int64_t buffer) {
  return translate_errors_on(group_name, [&] {
    const c10::cuda::CUDAGuard guard(x.device());
    ep::Runtime& rt = ep_runtime(std::string(group_name));
    const ep::Config& cfg = rt.config();
    UNIEP_CHECK(x.dim() == 2 && x.size(1) == cfg.hidden && x.scalar_type() == at::kBFloat16 &&
                    x.is_cuda() && x.is_contiguous(),
                "x must be contiguous bfloat16 CUDA [T, H = ", cfg.hidden, "], got ",
                x.scalar_type(), " ", x.sizes());
    check_topk_idx(topk_idx);
    UNIEP_CHECK(topk_idx.size(0) == x.size(0) && topk_idx.size(1) == cfg.top_k &&
                    topk_idx.device() == x.device(),
                "topk_idx must be [T = ", x.size(0), ", K = ", cfg.top_k, "] on x's device");
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index());
    ok_or_throw(rt.ll_dispatch(x.data_ptr(), topk_idx.data_ptr<int64_t>(), x.size(0),
                               static_cast<int>(buffer), stream));
    const int64_t El = cfg.num_experts / cfg.world_size, per = cfg.world_size * cfg.ll_max_tokens;
    const int64_t row = cfg.row_bytes_capacity() / 2;
    const int b = static_cast<int>(buffer);
    at::Tensor rows = at::from_blob(const_cast<void*>(rt.ll_received_rows(b)),
                                    {El, per, cfg.hidden}, {per * row, row, 1}, x.options());
    at::Tensor counts = at::from_blob(const_cast<int32_t*>(rt.ll_received_counts(b)),
                                      {El, cfg.world_size}, x.options().dtype(at::kInt));
    at::Tensor slots = at::from_blob(const_cast<int64_t*>(rt.ll_received_slots(b)), {El, per},
                                     x.options().dtype(at::kLong));
    return std::make_tuple(rows, counts, slots);
  });
}

at::Tensor ll_combine_cuda(const at::Tensor& y, const at::Tensor& topk_idx,
                           const at::Tensor& topk_weights, c10::string_view group_name,
                           int64_t buffer) {
  return translate_errors_on(group_name, [&] {
    const c10::cuda::CUDAGuard guard(y.device());
    ep::Runtime& rt = ep_runtime(std::string(group_name));
    const ep::Config& cfg = rt.config();
    const int64_t El = cfg.num_experts / cfg.world_size, per = cfg.world_size * cfg.ll_max_tokens;
    UNIEP_CHECK(y.dim() == 3 && y.size(0) == El && y.size(1) == per && y.size(2) == cfg.hidden &&
                    y.scalar_type() == at::kBFloat16 && y.is_cuda() && y.is_contiguous(),
                "y must be contiguous bfloat16 [E_local = ", El, ", W * ll_max_tokens = ", per,
                ", H = ", cfg.hidden, "] (the ll_dispatch layout), got ", y.scalar_type(), " ",
                y.sizes());
    check_topk_idx(topk_idx);
    UNIEP_CHECK(topk_idx.size(1) == cfg.top_k && topk_idx.device() == y.device(),
                "topk_idx must have K = ", cfg.top_k, " columns on y's device");
    UNIEP_CHECK(topk_weights.sizes() == topk_idx.sizes() &&
                    topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous() &&
                    topk_weights.device() == y.device(),
                "topk_weights must be contiguous float32 shaped like topk_idx on y's device");
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(y.device().index());
    at::Tensor out = at::empty({topk_idx.size(0), cfg.hidden}, y.options());
    ok_or_throw(rt.ll_combine(y.data_ptr(), topk_idx.data_ptr<int64_t>(),
                              topk_weights.data_ptr<float>(), topk_idx.size(0),
                              static_cast<int>(buffer), out.data_ptr(), stream));
    return out;
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("ll_dispatch", &uniep::torch_glue::ll_dispatch_cuda);
  m.impl("ll_combine", &uniep::torch_glue::ll_combine_cuda);
  m.impl("ep_dispatch", &uniep::torch_glue::ep_dispatch_cuda);
  m.impl("ep_dispatch_cached", &uniep::torch_glue::ep_dispatch_cached_cuda);
  m.impl("ep_combine", &uniep::torch_glue::ep_combine_cuda);
  m.impl("moe_forward", &uniep::torch_glue::moe_forward_cuda);
  m.impl("moe_backward_checks", &uniep::torch_glue::moe_backward_checks_cuda);
  m.impl("moe_backward_engine", &uniep::torch_glue::moe_backward_engine_cuda);
}
