// uniep::cuda::MoeLayer (include/uniep/cuda/moe_layer.hpp): at world 1 the plan and the MegaKernel
// of one forward over buffers allocated once (with fp8 experts the plan and uniep.moe.fp8_local's
// launches instead); across ranks the fused runtime (fused_ep.hpp). Host code only; the kernels
// are the plan's (expert_tiles.cu), the fused kernel's (sm90_forward*.cu), the fp8 path's
// (cpp/cuda/gemm) and the runtime's (cpp/runtime/megakernel_runtime.cu).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <utility>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/fused_ep.hpp"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/cuda/moe_layer.hpp"
#include "uniep/cuda/send_rows.hpp"
#include "uniep/cuda/tile_gate.hpp"
#include "uniep/send_rows_error.hpp"

namespace uniep::cuda {
namespace {

constexpr size_t kAlign = 256;
// The CTAs that send first across ranks (uniep.moe.megakernel.launch.EP_COMM_SMS: the best of
// five points at EP4 on four H200s on both measured layers, 2026-11-26, commit edef84b).
constexpr int kEpCommCtas = 32;
constexpr const char* kZeroing = "MoeLayer::forward (zeroing the error words)";

size_t align_up(size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

// Where each buffer of the layer lies in its one allocation, for max_tokens. With fp8 experts
// rows and act hold e4m3 bytes with their 1 x 128 scales beside them, h GEMM 1's bf16 output,
// and the MegaKernel's counters and workspace are the two fp8 GEMMs' workspaces instead.
struct Layout {
  size_t rows = 0, act = 0, y = 0, counters = 0, counts = 0, offs = 0, tile_base = 0;
  size_t dest = 0, gemm_row = 0, counter = 0, errors = 0, timeout = 0, plan_ws = 0, fused_ws = 0;
  size_t plan_ws_bytes = 0, fused_ws_bytes = 0, total = 0;
  size_t rows_scales = 0, h = 0, act_scales = 0, gemm1_ws = 0, gemm2_ws = 0;
  size_t gemm1_ws_bytes = 0, gemm2_ws_bytes = 0;
  int64_t num_counters = 0;  // each of the three counter arrays, for the largest call
};

Layout layout_for(const MoeLayerConfig& c, int tile_m, int sms) {
  const int64_t cap = c.max_tokens * c.top_k, E = c.num_experts;
  const bool fp8 = c.fp8_experts;
  const size_t element = fp8 ? 1 : 2;  // of rows and act
  Layout l;
  l.num_counters = fp8 ? 0 : cap / tile_m + E + 1;
  size_t at = 0;
  auto take = [&at](size_t bytes) {
    const size_t here = at;
    at += align_up(bytes);
    return here;
  };
  l.rows = take(static_cast<size_t>(cap * c.hidden) * element);
  l.act = take(static_cast<size_t>(cap * c.ffn) * element);
  l.y = take(static_cast<size_t>(cap * c.hidden) * 2);
  if (fp8) {
    l.rows_scales = take(static_cast<size_t>(cap * (c.hidden / 128)) * sizeof(float));
    l.act_scales = take(static_cast<size_t>(cap * (c.ffn / 128)) * sizeof(float));
    l.h = take(static_cast<size_t>(cap * (c.fp8_w1_packed ? 1 : 2) * c.ffn) * 2);
  }
  l.counters = take(static_cast<size_t>(3 * l.num_counters) * sizeof(uint32_t));
  l.counts = take(static_cast<size_t>(E) * sizeof(int64_t));
  l.offs = take(static_cast<size_t>(E) * sizeof(int32_t));
  l.tile_base = take(static_cast<size_t>(E + 1) * sizeof(int32_t));
  l.dest = take(static_cast<size_t>(cap) * sizeof(int64_t));
  l.gemm_row = take(static_cast<size_t>(cap) * sizeof(int64_t));
  l.counter = take(static_cast<size_t>(cap) * sizeof(int64_t));
  l.errors = take(2 * sizeof(unsigned long long));  // the plan's word, then the kernel's
  l.timeout = take(sizeof(GateTimeout));
  l.plan_ws_bytes = local_plan_workspace_bytes(cap, E);
  l.plan_ws = take(l.plan_ws_bytes);
  if (fp8) {
    l.gemm1_ws_bytes = grouped_gemm_fp8_workspace_bytes(E, cap, c.hidden, sms);
    l.gemm1_ws = take(l.gemm1_ws_bytes);
    l.gemm2_ws_bytes = grouped_gemm_fp8_workspace_bytes(E, cap, c.ffn, sms);
    l.gemm2_ws = take(l.gemm2_ws_bytes);
  } else {
    l.fused_ws_bytes = fused_moe_workspace_bytes(E, sms);
    l.fused_ws = take(l.fused_ws_bytes);
  }
  l.total = at;
  return l;
}

Status check_config(const MoeLayerConfig& c) {
  const auto bad = [](const char* what, auto value) {
    return Status{StatusCode::kInvalidArgument, detail::str_cat(what, ", got ", value)};
  };
  if (c.max_tokens < 1 || c.max_tokens > (int64_t{1} << 24))
    return bad("max_tokens must be in [1, 2^24]", c.max_tokens);
  if (c.hidden < 64 || c.hidden % 64 != 0 || c.hidden > (1 << 16))
    return bad("hidden must be a positive multiple of 64, at most 65536", c.hidden);
  if (c.ffn < 64 || c.ffn % 64 != 0 || c.ffn > (1 << 16))
    return bad("ffn must be a positive multiple of 64, at most 65536", c.ffn);
  if (c.num_experts < 1 || c.num_experts > (1 << 20))
    return bad("num_experts must be in [1, 2^20]", c.num_experts);
  if (c.top_k < 1 || c.top_k > 32) return bad("top_k must be in [1, 32]", c.top_k);
  if (c.world_size < 1 || c.world_size > kMaxFusedPeers)
    return bad("world_size must be in [1, 8] (the ranks of one NVLink domain)", c.world_size);
  if (c.rank < 0 || c.rank >= c.world_size) return bad("rank must be in [0, world_size)", c.rank);
  if (c.num_experts % c.world_size != 0)
    return bad("num_experts must be a multiple of world_size", c.num_experts);
  if (c.max_tokens * c.top_k > (int64_t{1} << 31) - 1)
    return bad("max_tokens x top_k must be below 2^31", c.max_tokens * c.top_k);
  if (c.tile_m != 0 && c.tile_m != 64 && c.tile_m != 128)
    return bad("tile_m must be 0 (auto), 64 or 128", c.tile_m);
  if (c.tile_n != 0 && c.tile_n != 256 && !(c.tile_n == 128 && c.tile_m != 128))
    return bad("tile_n must be 0 (auto), 256, or 128 with 64-row tiles", c.tile_n);
  if (c.w1_as_stored && c.ffn % (c.tile_n == 128 ? 64 : 128) != 0)
    return {
        StatusCode::kUnsupported,
        detail::str_cat("w1_as_stored needs ffn to be a multiple of ", c.tile_n == 128 ? 64 : 128,
                        ", got ", c.ffn, "; pass w1 in pack_gate_up's layout instead")};
  if (!(c.timeout_s >= 0 && c.timeout_s <= 3600))
    return bad("timeout_s must be in [0, 3600]", c.timeout_s);
  if (c.fp8_w1_packed && !c.fp8_experts)
    return {StatusCode::kInvalidArgument,
            "fp8_w1_packed describes fp8 experts' w1: set it only with fp8_experts"};
  if (c.fp8_experts) {
    if (c.world_size != 1)
      return {StatusCode::kUnsupported,
              detail::str_cat("fp8_experts runs at world_size 1 only, got ", c.world_size,
                              "; across ranks the layer takes bf16 experts")};
    if (c.hidden % 128 != 0 || c.ffn % 128 != 0)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("fp8_experts needs hidden and ffn to be multiples of 128 (whole "
                              "weight blocks), got hidden ",
                              c.hidden, " and ffn ", c.ffn)};
    if (c.w1_as_stored || c.tile_m != 0 || c.tile_n != 0)
      return {StatusCode::kInvalidArgument,
              "w1_as_stored, tile_m and tile_n are the bf16 MegaKernel's: leave them unset with "
              "fp8_experts (the fp8 GEMMs pick their tile by the rows per expert)"};
  }
  return Status::Ok();
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The layer's device current for a scope (launches go to the current device), the caller's after.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    ok_ = cudaGetDevice(&previous_) == cudaSuccess &&
          (previous_ == device || cudaSetDevice(device) == cudaSuccess);
  }
  ~DeviceScope() {
    if (ok_) cudaSetDevice(previous_);
  }
  bool ok() const { return ok_; }

 private:
  int previous_ = -1;
  bool ok_ = false;
};

}  // namespace

struct MoeLayer::State {
  MoeLayerConfig config;
  int tile_m = 128;
  int sms = 0;
  Layout layout;
  char* base = nullptr;
  std::unique_ptr<fused::Runtime> ep;  // across ranks; then base holds the error words only
  ~State() {
    if (base != nullptr) cudaFree(base);
  }
  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(base + offset);
  }
  // At creation, and before a call that does not zero them itself: the words then say nothing
  // of an earlier call. `what` names the caller in the error.
  Status zero_error_words(cudaStream_t stream, const char* what) const {
    if (cudaMemsetAsync(at<char>(layout.errors), 0, 2 * sizeof(unsigned long long), stream) !=
            cudaSuccess ||
        cudaMemsetAsync(at<char>(layout.timeout), 0, sizeof(GateTimeout), stream) != cudaSuccess)
      return launch_status(what);
    return Status::Ok();
  }
};

MoeLayer::MoeLayer(std::unique_ptr<State> state) : state_(std::move(state)) {}
MoeLayer::~MoeLayer() = default;

const MoeLayerConfig& MoeLayer::config() const {
  return state_->config;
}

size_t MoeLayer::device_bytes() const {
  return state_->layout.total;
}

namespace {

fused::Config fused_config(const MoeLayerConfig& c, int tile_m) {
  fused::Config f;
  f.world_size = c.world_size;
  f.rank = c.rank;
  f.max_tokens = c.max_tokens;
  f.hidden = c.hidden;
  f.ffn = c.ffn;
  f.top_k = c.top_k;
  f.num_experts = c.num_experts;
  f.timeout_s = c.timeout_s;
  f.tile_m = tile_m;
  return f;
}

// The tile height config.tile_m asks for, else fused_tile_m's choice for the most rows any rank
// may hold (world x max_tokens x top_k over the experts).
int choose_tile_m(const MoeLayerConfig& c, int device) {
  if (c.tile_m != 0) return c.tile_m;
  if (c.tile_n == 128) return 64;
  const int64_t rows = c.world_size * c.max_tokens * c.top_k;
  return rows <= grouped_gemm_pingpong_rows(device) * c.num_experts ? 64 : 128;
}

}  // namespace

size_t MoeLayer::symmetric_heap_bytes(const MoeLayerConfig& config) {
  if (config.world_size <= 1 || !check_config(config).ok()) return 0;
  // With 64-row tiles the runtime has the most tile counters: enough for either height.
  return fused::symmetric_heap_bytes(fused_config(config, 64));
}

Status MoeLayer::create(const MoeLayerConfig& config, std::unique_ptr<MoeLayer>* layer) {
  if (config.world_size > 1)
    return {StatusCode::kInvalidArgument,
            "world_size > 1: create the layer with rank 0's unique id, "
            "MoeLayer::create(config, unique_id, layer), on every rank"};
  return create(config, {}, layer);
}

Status MoeLayer::create(const MoeLayerConfig& config, const std::vector<uint8_t>& unique_id,
                        std::unique_ptr<MoeLayer>* layer) {
  if (layer == nullptr) return {StatusCode::kInvalidArgument, "layer must not be null"};
  if (Status s = check_config(config); !s.ok()) return s;
  auto state = std::make_unique<State>();
  state->config = config;
  int device = config.device;
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess)
    return launch_status("MoeLayer::create (current device)");
  state->config.device = device;
  if (!grouped_gemm_device_ok(device))
    return {StatusCode::kUnsupported,
            "MoeLayer needs a compute capability 9.0 GPU (the MegaKernel is built for sm_90a)"};
  if (cudaDeviceGetAttribute(&state->sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return launch_status("MoeLayer::create (device attributes)");
  state->tile_m = choose_tile_m(config, device);
  const bool ep = config.world_size > 1;
  if (ep) {
    // The runtime holds the rows, plans and counters; the layer only the call's error words.
    state->layout = Layout{};
    state->layout.errors = 0;
    state->layout.timeout = align_up(2 * sizeof(unsigned long long));
    state->layout.total = state->layout.timeout + align_up(sizeof(GateTimeout));
  } else {
    state->layout = layout_for(config, state->tile_m, state->sms);
  }
  const DeviceScope scope(device);
  if (!scope.ok()) return launch_status("MoeLayer::create (device)");
  const cudaError_t alloc = cudaMalloc(reinterpret_cast<void**>(&state->base), state->layout.total);
  if (alloc != cudaSuccess) {
    state->base = nullptr;
    cudaGetLastError();
    return {StatusCode::kInternal,
            detail::str_cat("MoeLayer::create: cudaMalloc of ", state->layout.total,
                            " bytes failed: ", cudaGetErrorString(alloc))};
  }
  // check() before the first forward finds nothing.
  if (Status st = state->zero_error_words(nullptr, "MoeLayer::create (zeroing the error words)");
      !st.ok())
    return st;
  if (cudaStreamSynchronize(nullptr) != cudaSuccess)
    return launch_status("MoeLayer::create (zeroing the error words)");
  if (ep) {
    if (unique_id.empty())
      return {StatusCode::kInvalidArgument,
              "unique_id must hold rank 0's uniep::ep::make_unique_id bytes with world_size > 1"};
    if (Status st =
            fused::Runtime::create(fused_config(config, state->tile_m), unique_id, &state->ep);
        !st.ok())
      return st;
  }
  layer->reset(new MoeLayer(std::move(state)));
  return Status::Ok();
}

namespace {

// fp8 experts at world 1 after the plan (uniep.moe.fp8_local's launches): each token quantized
// once into its GEMM rows, GEMM 1, the SwiGLU quantized for GEMM 2 (with fp8_w1_packed the
// SwiGLU in GEMM 1's epilogue and only the quantization after it), GEMM 2, the combine. The
// plan's error word covers every step (their rows are the plan's), so none fills a word of its
// own. The GEMMs run over all T x K rows; the rows past the last expert's end are neither
// computed nor read.
template <class State>
Status forward_fp8(const State& s, const MoeLayerInputs& in, const LocalPlanArgs& plan,
                   cudaStream_t stream) {
  const MoeLayerConfig& c = s.config;
  const int64_t rows = in.tokens * c.top_k, E = c.num_experts;
  void* q = s.template at<void>(s.layout.rows);
  auto* q_scales = s.template at<float>(s.layout.rows_scales);
  if (Status st = quantize_fp8_rows(in.x, in.tokens, c.hidden, plan.gemm_row,
                                    static_cast<int>(c.top_k), rows, q, q_scales, nullptr, stream);
      !st.ok())
    return st;
  GroupedGemmFp8Problem g1;
  g1.x = q;
  g1.x_scales = q_scales;
  g1.w = in.w1;
  g1.w_scales = in.w1_scales;
  g1.offs = plan.offs;
  g1.out = s.template at<void>(s.layout.h);
  g1.num_experts = E;
  g1.rows = rows;
  g1.k = c.hidden;
  g1.n = 2 * c.ffn;
  g1.swiglu = c.fp8_w1_packed;  // out: the activation [rows, ffn]
  if (Status st = grouped_gemm_fp8(g1, c.device, s.sms, s.template at<void>(s.layout.gemm1_ws),
                                   s.layout.gemm1_ws_bytes, stream);
      !st.ok())
    return st;
  void* act = s.template at<void>(s.layout.act);
  auto* act_scales = s.template at<float>(s.layout.act_scales);
  if (Status st = c.fp8_w1_packed ? quantize_fp8(g1.out, rows, c.ffn, act, act_scales, stream)
                                  : swiglu_fp8(g1.out, rows, c.ffn, act, act_scales, stream);
      !st.ok())
    return st;
  GroupedGemmFp8Problem g2 = g1;
  g2.swiglu = false;  // a plain product: [rows, hidden]
  g2.x = act;
  g2.x_scales = act_scales;
  g2.w = in.w2;
  g2.w_scales = in.w2_scales;
  g2.out = s.template at<void>(s.layout.y);
  g2.k = c.ffn;
  g2.n = c.hidden;
  if (Status st = grouped_gemm_fp8(g2, c.device, s.sms, s.template at<void>(s.layout.gemm2_ws),
                                   s.layout.gemm2_ws_bytes, stream);
      !st.ok())
    return st;
  // Four blocks an SM, as torch.ops.uniep.combine_rows launches it.
  return combine_rows_bf16(g2.out, rows, plan.gemm_row, in.topk_weights, in.tokens, c.top_k,
                           c.hidden, in.out, nullptr, 4 * s.sms, stream);
}

}  // namespace

Status MoeLayer::forward(const MoeLayerInputs& in, cudaStream_t stream) {
  State& s = *state_;
  const MoeLayerConfig& c = s.config;
  const DeviceScope scope(c.device);
  if (!scope.ok()) return launch_status("MoeLayer::forward (device)");
  if (in.tokens < 0 || in.tokens > c.max_tokens)
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat("tokens must be in [0, max_tokens = ", c.max_tokens, "], got ", in.tokens)};
  if (s.ep) {
    // Across ranks: a rank with no tokens still calls (its experts compute the peers' rows).
    if (in.w1 == nullptr || in.w2 == nullptr)
      return {StatusCode::kInvalidArgument, "w1 and w2 must be device pointers"};
    if (in.tokens > 0 && (in.x == nullptr || in.topk_idx == nullptr || in.topk_weights == nullptr ||
                          in.out == nullptr))
      return {StatusCode::kInvalidArgument,
              "x, topk_idx, topk_weights and out must be device pointers when tokens > 0"};
    if (Status st = s.zero_error_words(stream, kZeroing); !st.ok()) return st;
    fused::ForwardArgs f;
    f.x = in.x;
    f.topk_idx = in.topk_idx;
    f.topk_weights = in.topk_weights;
    f.tokens = in.tokens;
    f.w1_packed = in.w1;
    f.w1_as_stored = c.w1_as_stored;
    f.w2 = in.w2;
    f.out = in.out;
    f.error = s.at<unsigned long long>(s.layout.errors);
    f.timeout = s.at<GateTimeout>(s.layout.timeout);
    FusedMoeLaunch launch;
    launch.comm_ctas = kEpCommCtas;
    launch.tile_n = c.tile_n;
    return s.ep->forward(f, launch, stream);
  }
  if (in.tokens == 0) return s.zero_error_words(stream, kZeroing);  // nothing to compute
  const void* pointers[] = {in.x,  in.topk_idx, in.topk_weights, in.w1,
                            in.w2, in.out,      in.w1_scales,    in.w2_scales};
  const char* names[] = {"x",  "topk_idx", "topk_weights", "w1",
                         "w2", "out",      "w1_scales",    "w2_scales"};
  for (int i = 0; i < (c.fp8_experts ? 8 : 6); ++i) {
    if (pointers[i] == nullptr)
      return {StatusCode::kInvalidArgument, detail::str_cat(names[i], " must be a device pointer",
                                                            i >= 6 ? " with fp8_experts" : "")};
    if (i != 1 && i != 2 && !aligned16(pointers[i]))
      return {StatusCode::kInvalidArgument, detail::str_cat(names[i], " must be 16-byte aligned")};
  }
  const int64_t entries = in.tokens * c.top_k, E = c.num_experts;
  auto* errors = s.at<unsigned long long>(s.layout.errors);

  LocalPlanArgs plan;
  plan.topk_idx = in.topk_idx;
  plan.tokens = in.tokens;
  plan.top_k = c.top_k;
  plan.num_experts = E;
  plan.tile_m = s.tile_m;
  plan.counts = s.at<int64_t>(s.layout.counts);
  plan.offs = s.at<int32_t>(s.layout.offs);
  plan.tile_base = s.at<int32_t>(s.layout.tile_base);
  plan.dest_rank = s.at<int64_t>(s.layout.dest);
  plan.gemm_row = s.at<int64_t>(s.layout.gemm_row);
  plan.counter = s.at<int64_t>(s.layout.counter);
  plan.error = errors;
  // A decode batch in bf16 is planned by the MegaKernel's own first launch (two launches a
  // step, not three); the rest by the plan's kernels first.
  const bool planned_in_launch = !c.fp8_experts && fused_plan_fits(entries, E);
  // Sized at creation for max_tokens: enough for any call.
  if (!planned_in_launch)
    if (Status st = plan_local_rows_async(plan, s.at<void>(s.layout.plan_ws),
                                          s.layout.plan_ws_bytes, stream);
        !st.ok())
      return st;

  if (c.fp8_experts) return forward_fp8(s, in, plan, stream);

  // The call's own capacity and counters (as moe_forward_local's): the same tiles and bits.
  const int64_t num_counters = entries / s.tile_m + E + 1;
  auto* counters = s.at<uint32_t>(s.layout.counters);
  FusedMoeArgs a;
  a.x = in.x;
  a.tokens = in.tokens;
  a.hidden = c.hidden;
  a.top_k = c.top_k;
  a.topk_weights = in.topk_weights;
  a.w1_packed = in.w1;
  a.w1_as_stored = c.w1_as_stored;
  a.w2 = in.w2;
  a.num_experts = E;
  a.ffn = c.ffn;
  a.capacity = entries;
  a.rows = s.at<void>(s.layout.rows);
  a.act = s.at<void>(s.layout.act);
  a.y = s.at<void>(s.layout.y);
  a.out = in.out;
  a.counters = counters;
  a.done1 = counters + num_counters;
  a.done2 = counters + 2 * num_counters;
  a.num_counters = num_counters;
  a.error = errors + 1;
  a.timeout = s.at<GateTimeout>(s.layout.timeout);
  a.timeout_ns = static_cast<uint64_t>(c.timeout_s * 1e9);
  a.zero_state = true;
  FusedMoeLaunch launch;
  launch.comm_ctas = s.sms;  // every CTA sends first, token by token (no row inverse needed)
  launch.tile_m = s.tile_m;
  launch.tile_n = c.tile_n;
  if (planned_in_launch) {
    FusedLocalPlan p;
    p.topk_idx = plan.topk_idx;
    p.gemm_row = plan.gemm_row;
    p.counter = plan.counter;
    p.offs = plan.offs;
    p.tile_base = plan.tile_base;
    p.counts = plan.counts;
    p.error = plan.error;
    return moe_fused_forward_planned_bf16(a, p, launch, c.device, s.at<void>(s.layout.fused_ws),
                                          s.layout.fused_ws_bytes, stream);
  }
  a.gemm_row = plan.gemm_row;
  a.counter = plan.counter;
  a.offs = plan.offs;
  a.tile_base = plan.tile_base;
  return moe_fused_forward_bf16(a, launch, c.device, s.at<void>(s.layout.fused_ws),
                                s.layout.fused_ws_bytes, stream);
}

Status MoeLayer::check(cudaStream_t stream) {
  State& s = *state_;
  unsigned long long words[2] = {0, 0};
  GateTimeout timeout;
  if (cudaMemcpyAsync(words, s.at<char>(s.layout.errors), sizeof words, cudaMemcpyDeviceToHost,
                      stream) != cudaSuccess ||
      cudaMemcpyAsync(&timeout, s.at<char>(s.layout.timeout), sizeof timeout,
                      cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return launch_status("MoeLayer::check");
  for (unsigned long long word : words)
    if (Status st = send_rows_error_status(word, s.config.top_k, "MoeLayer::forward"); !st.ok())
      return st;
  return gate_timeout_status(timeout, "MoeLayer::forward");
}

}  // namespace uniep::cuda
