// moe_forward's world-1 path (local_forward.hpp).
#include "torch/ep/local_forward.hpp"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdint>

#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/gemm/grouped.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/cuda/send_rows.hpp"
#include "uniep/send_rows_error.hpp"

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
    const Status s = send_rows_error_status(word, K, "moe_forward (the world-1 plan)");
    return Error(s.code, s.message);
  }
  const int64_t entry = static_cast<int64_t>(word & ((uint64_t{1} << kSendErrorShift) - 1));
  const int64_t id = topk_idx.view(-1)[entry].item<int64_t>();
  return Error(StatusCode::kInvalidArgument,
               detail::str_cat("topk_idx contains expert id ", id, " at [", entry / K, ", ",
                               entry % K, "], outside [-1, ", num_experts, ")"));
}

}  // namespace

bool local_forward_takes(int64_t world_size, const at::Tensor& x, const TuningParams& params) {
  return world_size == 1 && x.scalar_type() == at::kBFloat16 && params.gemm == GemmEngine::kUniep &&
         !params.fp8_experts() && params.dispatch == DispatchPrecision::kBf16 &&
         params.combine == CombineReduction::kPerChoice;
}

at::Tensor local_moe_forward(const at::Tensor& x, const at::Tensor& topk_idx,
                             const at::Tensor& topk_weights, const at::Tensor& w1,
                             const at::Tensor& w2, const TuningParams& params,
                             cudaStream_t stream) {
  const int64_t T = topk_idx.size(0), K = topk_idx.size(1), H = x.size(1);
  const int64_t E = w1.size(0), I = w2.size(1), n = T * K;
  if (T == 0) return at::empty({0, H}, x.options());
  const auto i64 = topk_idx.options(), i32 = i64.dtype(at::kInt);

  // 1. The plan, and its error word on its way to the host.
  at::Tensor counts = at::empty({E}, i64), offs = at::empty({E}, i32);
  at::Tensor tile_base = at::empty({E + 1}, i32), plan = at::empty({3, n}, i64);
  at::Tensor error = at::empty({1}, i64);  // zeroed by the plan
  cuda::LocalPlanArgs a;
  a.topk_idx = topk_idx.data_ptr<int64_t>();
  a.tokens = T;
  a.top_k = K;
  a.num_experts = E;
  a.tile_m = kPlanTileM;
  a.counts = counts.data_ptr<int64_t>();
  a.offs = offs.data_ptr<int32_t>();
  a.tile_base = tile_base.data_ptr<int32_t>();
  a.dest_rank = plan[0].data_ptr<int64_t>();
  a.gemm_row = plan[1].data_ptr<int64_t>();
  a.counter = plan[2].data_ptr<int64_t>();
  a.error = reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>());
  const size_t ws_bytes = cuda::local_plan_workspace_bytes(n, E);
  const at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, i64.dtype(at::kByte));
  ok_or_throw(cuda::plan_local_rows_async(a, ws.data_ptr(), ws_bytes, stream));
  at::Tensor host_error = at::empty({1}, i64.device(at::kCPU).pinned_memory(true));
  host_error.copy_(error, /*non_blocking=*/true);
  const HostWait planned(stream);

  // 2. Each token's row at its GEMM rows.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, x.device().index()));
  at::Tensor rows = at::empty({n, H}, x.options());
  cuda::StoreRowsArgs s;
  s.x = x.data_ptr();
  s.x_stride = s.row_bytes = H * static_cast<int64_t>(x.element_size());
  s.tokens = T;
  s.top_k = K;
  s.gemm_row = a.gemm_row;
  s.rows = rows.data_ptr();
  s.row_stride = s.row_bytes;
  s.rows_capacity = n;
  const int64_t store_blocks =
      std::min<int64_t>((T + kWarpsPerBlock - 1) / kWarpsPerBlock, int64_t{sms} * 4);
  ok_or_throw(cuda::store_token_rows_async(s, static_cast<int>(store_blocks), stream));

  // 3. The experts, as the runtime's path runs them.
  at::Tensor act;
  if (plain_gate_up_ok(w1, params)) {
    act = engine_grouped_mm_swiglu_plain(rows, w1, offs, params);
  } else {
    const at::Tensor h = engine_grouped_mm(rows, w1, offs, params);
    act = at::empty({n, I}, h.options());
    ok_or_throw(cuda::swiglu_bf16(h.data_ptr(), n, I, act.data_ptr(), stream));
  }
  const at::Tensor y = engine_grouped_mm(act, w2, offs, params);

  // 4. The per-k combine; the plan's word covers its rows.
  at::Tensor out = at::empty({T, H}, x.options());
  ok_or_throw(cuda::combine_rows_bf16(y.data_ptr(), n, a.gemm_row, topk_weights.data_ptr<float>(),
                                      T, K, H, out.data_ptr(), nullptr, sms * 4, stream));
  planned.wait();
  if (const auto word = static_cast<uint64_t>(host_error.item<int64_t>()); word != 0)
    throw plan_error(word, topk_idx, E);
  return out;
}

}  // namespace uniep::torch_glue
