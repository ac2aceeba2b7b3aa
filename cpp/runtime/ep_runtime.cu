// The expert-parallel runtime: NVSHMEM bootstrap from a unique id, one symmetric allocation
// carved into the buffers of uniep/cuda/ep.hpp, and the host side of notify/dispatch/combine.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/ep_kernels.hpp"
#include "runtime/nvshmem_session.hpp"
#include "runtime/runtime_support.hpp"
#include "uniep/cuda/ep.hpp"
#include "uniep/cuda/layout.hpp"
#include "uniep/shape.hpp"

namespace uniep::ep {
namespace {

using cuda::DeviceError;
using cuda::EpDims;
using cuda::PlanCounts;
using cuda::SymmetricView;

struct Carve {
  size_t signals, tally, counts, stage, recv_x, recv_meta, recv_weights, combine, total;
  size_t ll_x[2], ll_meta[2], ll_count[2], ll_combine[2], ll_back[2];
};

Carve carve(const Config& c) {
  const size_t W = c.world_size, E = c.num_experts, K = c.top_k, T = c.max_tokens;
  Carve v{};
  runtime::HeapCarver heap;
  v.signals = heap.take(sizeof(uint64_t) * cuda::kSignalKinds * W);
  v.tally = heap.take(sizeof(cuda::CompletionTally) * cuda::kSignalKinds);
  v.counts = heap.take(sizeof(int64_t) * 2 * W * (W + E + 1));
  v.stage = heap.take(sizeof(int64_t) * (W + E + 1));
  v.recv_x = heap.take(W * T * static_cast<size_t>(c.row_bytes_capacity()));
  v.recv_meta = heap.take(sizeof(int64_t) * W * T * (1 + K));
  v.recv_weights = heap.take(sizeof(float) * W * T * K);
  // (token, k) rows, or with combine=rank_partials (token, rank) rows.
  v.combine = heap.take(T * (K > W ? K : W) * static_cast<size_t>(c.hidden) * 2);
  const size_t El = E / W, L = c.ll_max_tokens;
  for (int b = 0; b < 2; ++b) {
    v.ll_x[b] = heap.take(El * W * L * static_cast<size_t>(c.row_bytes_capacity()));
    v.ll_meta[b] = heap.take(sizeof(int64_t) * El * W * L);
    v.ll_count[b] = heap.take(sizeof(uint64_t) * El * W);
    v.ll_combine[b] = heap.take(L * K * static_cast<size_t>(c.hidden) * 2);
    v.ll_back[b] = heap.take(sizeof(uint64_t) * El * W);
  }
  v.total = heap.total();
  return v;
}

const char* op_name(uint32_t op) {
  switch (static_cast<cuda::WaitOp>(op)) {
    case cuda::WaitOp::kNotify:
      return "notify (count exchange)";
    case cuda::WaitOp::kDispatch:
      return "dispatch";
    case cuda::WaitOp::kCombine:
      return "combine";
    case cuda::WaitOp::kCapacity:
      return "low-latency dispatch (capacity)";
    case cuda::WaitOp::kCombineTarget:
    case cuda::WaitOp::kCombineMissing:
    case cuda::WaitOp::kCombineWeights:
      return "combine (rank partials)";
    case cuda::WaitOp::kPlanMismatch:
    case cuda::WaitOp::kPeerArgs:
    case cuda::WaitOp::kRoundMismatch:
      return "cached dispatch (plan reuse)";
    case cuda::WaitOp::kExpertRows:
      return "dispatch (row lists)";
    case cuda::WaitOp::kBadExpert:
      return "low-latency dispatch (routing)";
    default:
      return "?";
  }
}

class RuntimeImpl final : public Runtime {
 public:
  explicit RuntimeImpl(const Config& c) : cfg_(c) {}
  ~RuntimeImpl() override {
    // nvshmem_free is collective; a runtime is destroyed by every rank together
    // (uniep.shutdown), never from a static destructor.
    if (side_) cudaStreamSynchronize(side_);
    heap_.close();
    if (workspace_) cudaFree(workspace_);
    if (unit_rows_) cudaFree(unit_rows_);
    if (row_of_target_) cudaFree(row_of_target_);
    for (cudaEvent_t& e : side_events_)
      if (e) cudaEventDestroy(e);
    if (side_) cudaStreamDestroy(side_);
    if (host_) cudaFreeHost(host_);
  }

  Status init(const std::vector<uint8_t>& uid) {
    const Carve layout = carve(cfg_);
    if (Status s = heap_.open(uid, cfg_.world_size, cfg_.rank, layout.total, "",
                              "raise NVSHMEM_SYMMETRIC_SIZE or lower max_tokens");
        !s.ok())
      return s;
    auto* base = heap_.base();
    sym_.signals = reinterpret_cast<uint64_t*>(base + layout.signals);
    sym_.tally = reinterpret_cast<cuda::CompletionTally*>(base + layout.tally);
    sym_.counts = reinterpret_cast<int64_t*>(base + layout.counts);
    sym_.count_stage = reinterpret_cast<int64_t*>(base + layout.stage);
    sym_.recv_x = base + layout.recv_x;
    sym_.recv_meta = reinterpret_cast<int64_t*>(base + layout.recv_meta);
    sym_.recv_weights = reinterpret_cast<float*>(base + layout.recv_weights);
    sym_.combine = base + layout.combine;
    all_peers_mapped_ = heap_.all_peers_mapped();
    ll_.ll_tokens = cfg_.ll_max_tokens;
    for (int b = 0; b < 2; ++b) {
      ll_.x[b] = base + layout.ll_x[b];
      ll_.meta[b] = reinterpret_cast<int64_t*>(base + layout.ll_meta[b]);
      ll_.count[b] = reinterpret_cast<uint64_t*>(base + layout.ll_count[b]);
      ll_.combine[b] = base + layout.ll_combine[b];
      ll_.back[b] = reinterpret_cast<uint64_t*>(base + layout.ll_back[b]);
      // Signals must read zero on every rank before any peer may set them.
      UNIEP_CUDA_OK(cudaMemset(ll_.count[b], 0, layout.ll_combine[b] - layout.ll_count[b]));
      UNIEP_CUDA_OK(cudaMemset(ll_.back[b], 0, sizeof(uint64_t) * cfg_.num_experts));
    }
    // Signals must read zero on every rank before any peer may add to them.
    UNIEP_CUDA_OK(cudaMemset(base, 0, layout.recv_x));
    if (Status s = heap_.barrier(); !s.ok()) return s;

    int device = 0;
    UNIEP_CUDA_OK(cudaGetDevice(&device));
    UNIEP_CUDA_OK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    dims_ = {cfg_.world_size, cfg_.rank,   cfg_.num_experts, cfg_.num_experts / cfg_.world_size,
             cfg_.top_k,      cfg_.hidden, cfg_.max_tokens,  cfg_.row_bytes_capacity()};
    const int64_t W = cfg_.world_size, E = cfg_.num_experts, El = dims_.experts_per_rank,
                  T = cfg_.max_tokens;
    // Device workspace: layout outputs, send indices, plan counts, layout error word.
    const size_t ws = sizeof(int64_t) * (W + E + T * W + (W + 1) + W + (El + 1) + W + El) +
                      sizeof(int32_t) * 2 * El * W + sizeof(float) * T * cfg_.top_k +
                      sizeof(bool) * T * W + sizeof(unsigned long long) + sizeof(int64_t) + 64;
    UNIEP_CUDA_OK(cudaMalloc(&workspace_, ws));
    auto* p = static_cast<int64_t*>(workspace_);
    tokens_per_rank_ = p, p += W;
    tokens_per_expert_ = p, p += E;
    send_index_ = p, p += T * W;
    plan_.recv_offsets = p, p += W + 1;
    plan_.send_base = p, p += W;
    plan_.expert_offsets = p, p += El + 1;
    plan_.rows_back = p, p += W;
    rows_per_local_expert_ = p, p += El;
    ll_.recv_count = reinterpret_cast<int32_t*>(p), p += (2 * El * W + 1) / 2;
    UNIEP_CUDA_OK(cudaMemset(ll_.recv_count, 0, sizeof(int32_t) * 2 * El * W));
    layout_error_ = reinterpret_cast<unsigned long long*>(p), p += 1;
    dispatched_weights_ = reinterpret_cast<float*>(p), p += (T * cfg_.top_k + 1) / 2;
    round_ok_ = reinterpret_cast<int32_t*>(p), p += 1;
    token_in_rank_ = reinterpret_cast<bool*>(p);
    plan_.sent_to = tokens_per_rank_;
    UNIEP_CUDA_OK(cudaMalloc(&unit_rows_, cuda::expert_rows_scratch_bytes(W * T, El)));

    // Host-mapped: the error word, and the counts the host reads after notify with the word that
    // says they are this round's (see wait_for_counts).
    const size_t host_bytes = sizeof(DeviceError) + sizeof(int64_t) * (1 + W + El + W + 1);
    UNIEP_CUDA_OK(cudaHostAlloc(&host_, host_bytes, cudaHostAllocMapped));
    std::memset(host_, 0, host_bytes);
    err_host_ = static_cast<DeviceError*>(host_);
    counts_host_ = reinterpret_cast<int64_t*>(static_cast<uint8_t*>(host_) + sizeof(DeviceError));
    UNIEP_CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0));
    UNIEP_CUDA_OK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&counts_dev_), counts_host_, 0));
    // Our own rows and the grouped-GEMM row lists run beside the transfer and the copy-out (see
    // end_dispatch).
    UNIEP_CUDA_OK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    for (cudaEvent_t& e : side_events_)
      UNIEP_CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return Status::Ok();
  }

  const Config& config() const override { return cfg_; }
  bool owns_nvshmem() const override { return heap_.started(); }
  const void* received_rows() const override { return sym_.recv_x; }
  const int64_t* rows_per_local_expert() const override { return rows_per_local_expert_; }
  uint64_t epoch() const override { return epoch_; }

  Status ll_dispatch(const void* x, const int64_t* topk_idx, int64_t tokens, int buffer,
                     cudaStream_t stream) override {
    if (Status s = ll_checks(tokens, buffer); !s.ok()) return s;
    cuda::launch_ll_dispatch(ll_, dims_, buffer, static_cast<const uint8_t*>(x), topk_idx, tokens,
                             timeout_ns(), err_dev_, stream);
    UNIEP_CUDA_OK(cudaGetLastError());
    ll_pending_[buffer] = true;
    return Status::Ok();
  }

  Status ll_combine(const void* y, const int64_t* topk_idx, const float* topk_weights,
                    int64_t tokens, int buffer, void* out, cudaStream_t stream) override {
    if (Status s = ll_checks(tokens, buffer); !s.ok()) return s;
    if (!ll_pending_[buffer])
      return {StatusCode::kInvalidArgument,
              detail::str_cat("ll_combine of buffer ", buffer,
                              " needs an ll_dispatch on that buffer first; each is combined once "
                              "(its completion words hold one round)")};
    ll_pending_[buffer] = false;
    cuda::launch_ll_combine(ll_, dims_, buffer, static_cast<const uint8_t*>(y), topk_idx,
                            topk_weights, tokens, static_cast<uint8_t*>(out), copy_blocks(),
                            timeout_ns(), err_dev_, stream);
    UNIEP_CUDA_OK(cudaGetLastError());
    return Status::Ok();
  }

  const void* ll_received_rows(int buffer) const override { return ll_.x[buffer & 1]; }
  const int32_t* ll_received_counts(int buffer) const override {
    return ll_.recv_count + (buffer & 1) * dims_.experts_per_rank * cfg_.world_size;
  }
  const int64_t* ll_received_slots(int buffer) const override { return ll_.meta[buffer & 1]; }

  Status check_device_errors(cudaStream_t stream) override {
    UNIEP_CUDA_OK(cudaStreamSynchronize(stream));
    return take_device_error();
  }

  Status begin_dispatch(const DispatchInput& in, cudaStream_t stream,
                        DispatchCounts* counts) override {
    if (Status s = runtime::refuse_capture(
            stream,
            "a dispatch with new routing cannot be captured in a CUDA graph: the host reads "
            "the round's counts to size its outputs; decode steps in graphs use ll_dispatch");
        !s.ok())
      return s;
    // A rank that refuses its round still takes part in the count exchange, so its peers fail
    // at once instead of waiting for its counts until their timeout.
    if (Status s = check_input(in, /*rows_only=*/false); !s.ok())
      return failed_round(false, s, stream);
    if (Status s = take_device_error(); !s.ok()) return failed_round(false, s, stream);
    if (in.tokens < 0 || in.tokens > cfg_.max_tokens)
      return failed_round(
          false,
          {StatusCode::kCapacityExceeded,
           detail::str_cat("x has ", in.tokens, " tokens but the runtime was created for at most ",
                           cfg_.max_tokens, " (max_tokens); re-create it with a larger one")},
          stream);
    Status s = cuda::routing_layout_async(in.topk_idx, in.tokens, cfg_.top_k, cfg_.num_experts,
                                          cfg_.world_size, tokens_per_rank_, tokens_per_expert_,
                                          token_in_rank_, layout_error_, stream);
    if (!s.ok()) return s;
    start_round(/*reused=*/false);
    last_tokens_ = -1;
    cuda::launch_notify(sym_, dims_, tokens_per_rank_, tokens_per_expert_, layout_error_,
                        token_in_rank_, in.tokens, epoch_, timeout_ns(), plan_, counts_dev_,
                        rows_per_local_expert_, send_index_, round_ok_, err_dev_, signature_of(in),
                        /*args_invalid=*/false, stream);
    UNIEP_CUDA_OK(cudaGetLastError());
    // Enqueued before the host reads the counts: the rows travel while it waits for them and
    // sizes the outputs. A failed round leaves round_ok at 0, and these kernels do nothing.
    if (Status t = start_transfer(in, stream); !t.ok()) return t;
    if (Status w = wait_for_counts(stream); !w.ok()) return w;
    if (Status e = take_device_error(); !e.ok()) return e;
    if (counts_host_[0] < 0) {
      // Every rank stops here together; the rank with the bad id reports the entry.
      const int64_t bad = -1 - counts_host_[0], W = cfg_.world_size;
      if (bad >= 3 * W)
        return {StatusCode::kInvalidArgument,
                detail::str_cat("dispatch on rank ", cfg_.rank, ": rank ", bad - 3 * W,
                                "'s round differs from rank 0's: ",
                                describe_round(counts_host_[2], bad - 3 * W), " against ",
                                describe_round(counts_host_[1], 0),
                                "; every rank must dispatch the same row size, precision (tuning "
                                "dispatch) and combine (tuning combine). Nothing was sent")};
      if (bad >= 2 * W)
        return {StatusCode::kInvalidArgument,
                detail::str_cat("dispatch on rank ", cfg_.rank, ": rank ", bad - 2 * W,
                                " failed its argument checks in its dispatch (its error names "
                                "the argument). Nothing was sent")};
      if (bad >= W)
        return {StatusCode::kInvalidArgument,
                detail::str_cat("rank ", bad - W,
                                " dispatched on its cached plan (a handle) while this rank passed "
                                "new routing; every rank must do the same kind of dispatch")};
      if (bad == cfg_.rank) {
        s = cuda::check_routing_layout(in.topk_idx, cfg_.top_k, cfg_.num_experts, layout_error_,
                                       stream);
        if (!s.ok()) return s;
      }
      return {
          StatusCode::kInvalidArgument,
          detail::str_cat("rank ", bad, " passed an invalid topk_idx (an expert id outside [-1, ",
                          cfg_.num_experts, ")); its error names the entry")};
    }
    const int64_t W = cfg_.world_size, El = dims_.experts_per_rank;
    counts->num_recv = counts_host_[0];
    counts->recv_from_rank.assign(counts_host_ + 1, counts_host_ + 1 + W);
    counts->rows_per_expert.assign(counts_host_ + 1 + W, counts_host_ + 1 + W + El);
    counts->rows_back_from_rank.assign(counts_host_ + 1 + W + El, counts_host_ + 1 + W + El + W);
    last_ = *counts;
    last_tokens_ = in.tokens;
    plan_epoch_ = epoch_;
    begun_ = true;
    return Status::Ok();
  }

  Status begin_cached_dispatch(uint64_t plan_epoch, const DispatchInput& in, cudaStream_t stream,
                               DispatchCounts* counts) override {
    // Nothing here syncs, so a capture would not fail by itself: it would freeze this round's
    // epoch into a graph whose replays then pass the barrier at once.
    if (Status s = runtime::refuse_capture(
            stream,
            "a cached dispatch cannot be captured in a CUDA graph: its barrier carries a fresh "
            "epoch from the host; decode steps in graphs use ll_dispatch");
        !s.ok())
      return s;
    // As in begin_dispatch: a refused round still passes the barrier, failing it on every rank.
    if (Status s = check_input(in, /*rows_only=*/true); !s.ok())
      return failed_round(true, s, stream);
    if (Status s = take_device_error(); !s.ok()) return failed_round(true, s, stream);
    if (last_tokens_ < 0)
      return failed_round(true,
                          {StatusCode::kInvalidArgument,
                           "a cached dispatch needs a plan: dispatch with topk_idx first"},
                          stream);
    if (plan_epoch < plan_epoch_ || plan_epoch > epoch_)
      return failed_round(
          true,
          {StatusCode::kInvalidArgument,
           detail::str_cat("the handle of epoch ", plan_epoch,
                           " names a plan the runtime no longer holds (its plan is that of "
                           "epoch ",
                           plan_epoch_, ", rounds up to ", epoch_,
                           "); a later dispatch with new routing replaced it: dispatch with "
                           "topk_idx instead")},
          stream);
    if (in.tokens != last_tokens_)
      return failed_round(true,
                          {StatusCode::kInvalidArgument,
                           detail::str_cat("a cached dispatch got ", in.tokens,
                                           " tokens but its plan was made for ", last_tokens_)},
                          stream);
    start_round(/*reused=*/true);
    cuda::launch_reuse_plan(sym_, dims_, epoch_, timeout_ns(), round_ok_, err_dev_,
                            signature_of(in), /*args_invalid=*/false, stream);
    UNIEP_CUDA_OK(cudaGetLastError());
    if (Status t = start_transfer(in, stream); !t.ok()) return t;
    *counts = last_;
    begun_ = true;
    return Status::Ok();
  }

  Status end_dispatch(const DispatchOutput& out, cudaStream_t stream) override {
    if (!begun_)
      return {StatusCode::kInvalidArgument,
              dispatched_ ? "end_dispatch already ran for this dispatch; begin a new one"
                          : "end_dispatch needs a dispatch begun by begin_dispatch or "
                            "begin_cached_dispatch (that succeeded)"};
    const bool fp8 = transfer_.fp8_hidden > 0, any = last_.num_recv > 0;
    if (fp8 && out.recv_x != nullptr && out.recv_scales == nullptr)
      return {StatusCode::kInvalidArgument, "fp8 dispatch with recv_x needs recv_scales"};
    if (reused_ && out.recv_x == nullptr && any)
      return {StatusCode::kInvalidArgument,
              "a cached dispatch writes its rows out: pass recv_x (the runtime's buffer may "
              "still hold rows a caller reads)"};
    if (!reused_ && any &&
        (out.recv_src == nullptr || out.recv_topk_idx == nullptr ||
         out.recv_topk_weights == nullptr))
      return {StatusCode::kInvalidArgument,
              "a dispatch with new routing writes recv_src, recv_topk_idx and recv_topk_weights: "
              "pass all three"};
    if ((out.row_slot == nullptr) != (out.row_target == nullptr))
      return {StatusCode::kInvalidArgument, "pass both row_slot and row_target, or neither"};
    begun_ = false;
    dispatched_ = true;
    const cuda::DispatchOutputs o{static_cast<uint8_t*>(out.recv_x), out.recv_scales, out.recv_src,
                                  out.recv_topk_idx, out.recv_topk_weights};
    // Side stream (a large round, see start_transfer): our own rows, from the send slots on
    // (beside the transfer); then the row lists, which read the received metadata like the
    // copy-out (bandwidth-bound) does, but are latency-bound. Joined before anything the caller
    // enqueues next. A small round runs both on the caller's stream, after the transfer.
    const cudaStream_t own = beside_ ? side_ : stream;
    if (beside_) UNIEP_CUDA_OK(cudaStreamWaitEvent(side_, side_events_[kSlotsReady], 0));
    cuda::launch_self_rows(sym_, dims_, transfer_, o,
                           beside_ ? std::max(1, sm_count_ - transfer_sms_) : sm_count_, own);
    UNIEP_CUDA_OK(cudaGetLastError());
    if (out.row_slot != nullptr && !reused_) {
      if (beside_) UNIEP_CUDA_OK(cudaStreamWaitEvent(side_, side_events_[kTransferred], 0));
      const int64_t K = cfg_.top_k;
      const cuda::ExpertRowsArgs rows{sym_.recv_meta,
                                      sym_.recv_meta + 1,
                                      1 + K,
                                      1 + K,
                                      last_.num_recv,
                                      plan_.recv_offsets,
                                      plan_.expert_offsets,
                                      cfg_.world_size,
                                      cfg_.rank * dims_.experts_per_rank,
                                      dims_.experts_per_rank,
                                      K,
                                      cfg_.max_tokens,
                                      static_cast<int64_t*>(unit_rows_),
                                      out.row_slot,
                                      out.row_target,
                                      err_dev_};
      cuda::launch_expert_rows(rows, own);
      UNIEP_CUDA_OK(cudaGetLastError());
    }
    if (beside_) UNIEP_CUDA_OK(cudaEventRecord(side_events_[kSideDone], side_));
    cuda::launch_copy_out(sym_, dims_, transfer_, o, copy_blocks(), stream);
    UNIEP_CUDA_OK(cudaGetLastError());
    if (beside_) UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, side_events_[kSideDone], 0));
    return Status::Ok();
  }

  Status fail_round(bool cached, cudaStream_t stream) override {
    return failed_round(cached, Status::Ok(), stream);
  }

  Status check_dispatch_args(int64_t row_bytes, int num_sms, bool fp8) const override {
    if (row_bytes <= 0 || row_bytes % 16 != 0 || row_bytes > cfg_.row_bytes_capacity())
      return {StatusCode::kInvalidArgument,
              detail::str_cat("x rows must be a multiple of 16 bytes and at most ",
                              cfg_.row_bytes_capacity(), " bytes, got ", row_bytes)};
    if (num_sms < 1 || num_sms > sm_count_)
      return {
          StatusCode::kInvalidArgument,
          detail::str_cat("num_sms (tuning sms) must be in [1, ", sm_count_,
                          "] (blocks wait on each other, so all must be resident), got ", num_sms)};
    if (fp8) {
      if (cfg_.hidden % 128 != 0 || row_bytes != cfg_.hidden * 2)
        return {StatusCode::kInvalidArgument,
                detail::str_cat("fp8 dispatch takes bf16 x of hidden = ", cfg_.hidden,
                                " columns, a multiple of 128; got rows of ", row_bytes, " bytes")};
      if (!all_peers_mapped_)
        return {StatusCode::kUnsupported,
                "fp8 dispatch casts into the peer's buffer and needs every peer reachable over "
                "NVLink (nvshmem_ptr); use dispatch=bf16 across nodes"};
    }
    return Status::Ok();
  }

  Status combine(const void* y, const int64_t* row_target, int64_t rows, const int64_t* topk_idx,
                 const float* topk_weights, int64_t tokens, int num_sms, CombineReduction reduction,
                 void* out, uint64_t epoch, cudaStream_t stream, bool y_fp32) override {
    if (epoch != epoch_ || !dispatched_)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("combine answers the dispatch of epoch ", epoch,
                              " but the runtime's last dispatch is epoch ", epoch_,
                              dispatched_ ? "" : " (not dispatched yet)",
                              ": combine each dispatch before the next one")};
    if (combined_)
      return {StatusCode::kInvalidArgument,
              "this dispatch was combined already; each dispatch is combined once"};
    int64_t planned_rows = 0;
    for (int64_t r : last_.rows_per_expert) planned_rows += r;
    if (rows != planned_rows)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("y must have the ", planned_rows,
                              " expert rows of the last dispatch, got ", rows)};
    if (tokens != last_tokens_)
      return {
          StatusCode::kInvalidArgument,
          detail::str_cat("combine got ", tokens, " tokens but the dispatch had ", last_tokens_)};
    if (cfg_.hidden % 8 != 0)
      return {StatusCode::kInvalidArgument, "hidden must be a multiple of 8 for the GPU combine"};
    if (num_sms < 1 || num_sms > sm_count_)
      return {StatusCode::kInvalidArgument, detail::str_cat("num_sms (tuning sms) must be in [1, ",
                                                            sm_count_, "], got ", num_sms)};
    cuda::CombineArgs a{static_cast<const uint8_t*>(y),
                        row_target,
                        rows,
                        topk_idx,
                        topk_weights,
                        tokens,
                        plan_,
                        static_cast<uint8_t*>(out),
                        timeout_ns(),
                        err_dev_,
                        y_fp32};
    if (y_fp32 && reduction != CombineReduction::kRankPartials)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("fp32 expert rows (y) are summed by combine=rank_partials only; "
                              "combine=",
                              combine_reduction_name(reduction), " sends bf16 rows")};
    if (reduction == CombineReduction::kRankPartials) {
      if (!all_peers_mapped_)
        return {StatusCode::kUnsupported,
                "combine=rank_partials stores the partials into the peers' buffers and needs "
                "every peer reachable over NVLink (nvshmem_ptr); use combine=per_k across nodes"};
      if (!weights_kept_)
        return {StatusCode::kInvalidArgument,
                "combine=rank_partials answers a dispatch made with combine=rank_partials in its "
                "tuning (that dispatch keeps the weights the expert ranks apply); this one was "
                "dispatched for combine=per_k"};
      if (round_combine_ != CombineReduction::kRankPartials)
        return round_combine_mismatch(reduction);
      if (Status s = ensure_row_index(stream); !s.ok()) return s;
      const cuda::RankPartialsArgs p{row_of_target_, static_cast<uint32_t>(epoch_),
                                     dispatched_weights_, token_in_rank_};
      cuda::launch_combine_rank_partials(sym_, dims_, a, p, num_sms, stream);
    } else {
      // The peers combine as their round said (the rounds agreed on it): a rank that combined
      // otherwise would write where they do not read.
      if (round_combine_ != CombineReduction::kPerChoice) return round_combine_mismatch(reduction);
      // Our own rows skip the copy when the row index can be had (else they are copied, as
      // rows to peers are: the same bits either way).
      cuda::SelfRowIndex self{nullptr, static_cast<uint32_t>(epoch_)};
      if (ensure_row_index(stream).ok())
        self.row_of_slot =
            row_of_target_ + static_cast<int64_t>(cfg_.rank) * cfg_.max_tokens * cfg_.top_k;
      cuda::launch_combine(sym_, dims_, a, self, num_sms, copy_blocks(), stream);
    }
    UNIEP_CUDA_OK(cudaGetLastError());
    combined_ = true;
    return Status::Ok();
  }

 private:
  uint64_t timeout_ns() const { return static_cast<uint64_t>(cfg_.timeout_s * 1e9); }

  Status round_combine_mismatch(CombineReduction asked) const {
    return {StatusCode::kInvalidArgument,
            detail::str_cat("combine=", combine_reduction_name(asked),
                            " answers a dispatch round made for combine=",
                            combine_reduction_name(round_combine_),
                            " (tuning combine); combine with the round's tuning (its handle's)")};
  }

  static int64_t signature_of(const DispatchInput& in) {
    return cuda::round_signature(in.row_bytes, in.fp8,
                                 in.combine == CombineReduction::kRankPartials);
  }

  static std::string describe_round(int64_t word, int64_t rank) {
    const int64_t sig = cuda::word_signature(word);
    return detail::str_cat("rank ", rank, " sends rows of ", sig >> 2, " bytes in ",
                           (sig & 1) ? "fp8" : "their own dtype (bf16 or other)",
                           " for combine=", (sig & 2) ? "rank_partials" : "per_k");
  }

  // This rank refused its round (`why`): it still takes part in the round's exchange (the count
  // exchange, or a cached dispatch's barrier) with a verdict that fails it on every rank, and
  // sends nothing. Keeps the epochs of the ranks in step. Returns `why`. Under CUDA-graph
  // capture nothing is launched (a captured exchange would replay later).
  Status failed_round(bool cached, Status why, cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess ||
        capture != cudaStreamCaptureStatusNone) {
      (void)cudaGetLastError();
      return why;
    }
    start_round(cached);
    if (cached) {
      cuda::launch_reuse_plan(sym_, dims_, epoch_, timeout_ns(), round_ok_, err_dev_, 0,
                              /*args_invalid=*/true, stream);
      if (cudaGetLastError() != cudaSuccess) return why;
    } else {
      // This rank's plan stays (its layout, send indices and plan were not touched: the
      // exchange ends before them), so ranks that all refused the round keep theirs; a peer
      // that did start the round dropped its plan, and a cached dispatch on it then fails there.
      cuda::launch_notify(sym_, dims_, tokens_per_rank_, tokens_per_expert_, layout_error_,
                          token_in_rank_, 0, epoch_, timeout_ns(), plan_, counts_dev_,
                          rows_per_local_expert_, send_index_, round_ok_, err_dev_, 0,
                          /*args_invalid=*/true, stream);
      if (cudaGetLastError() != cudaSuccess) return why;
      // Bounded: the exchange's waits time out. A peer's timeout here is not this call's news.
      (void)wait_for_counts(stream);
      (void)take_device_error();
    }
    return why;
  }

  // A new epoch; the round's state starts over.
  void start_round(bool reused) {
    ++epoch_;
    begun_ = false;
    dispatched_ = false;
    combined_ = false;
    reused_ = reused;
  }

  Status check_input(const DispatchInput& in, bool rows_only) const {
    if (Status s = check_dispatch_args(in.row_bytes, in.num_sms, in.fp8); !s.ok()) return s;
    if (in.combine == CombineReduction::kNodePartials)
      return {StatusCode::kInvalidArgument,
              "combine=node_partials is the combine of a group that spans nodes (one partial per "
              "(token, node): docs/multinode.md); the CUDA runtime of one NVLink domain combines "
              "with per_k or rank_partials"};
    if (in.tokens > 0 &&
        (in.x == nullptr || (!rows_only && (in.topk_idx == nullptr || in.topk_weights == nullptr))))
      return {StatusCode::kInvalidArgument,
              "DispatchInput needs device pointers x, topk_idx and topk_weights for its tokens"};
    return Status::Ok();
  }

  // The transfer of the round's rows on `stream`, with the events end_dispatch's side stream
  // waits on: send slots ready (our own rows need only those), every peer's rows in.
  Status start_transfer(const DispatchInput& in, cudaStream_t stream) {
    // combine=rank_partials applies these weights on the expert side; its reduction checks that
    // the combine's are the same. Kept only for such a combine: a copy on every dispatch's path.
    // A cached dispatch moves rows only: the slots keep the plan dispatch's weights, and so does
    // the copy a rank_partials combine checks against.
    if (!reused_) weights_kept_ = in.combine == CombineReduction::kRankPartials;
    round_combine_ = in.combine;
    if (!reused_ && weights_kept_ && in.tokens > 0)
      UNIEP_CUDA_OK(cudaMemcpyAsync(dispatched_weights_, in.topk_weights,
                                    sizeof(float) * in.tokens * cfg_.top_k,
                                    cudaMemcpyDeviceToDevice, stream));
    transfer_ = cuda::DispatchArgs{static_cast<const uint8_t*>(in.x),
                                   in.row_bytes,
                                   in.fp8 ? cfg_.hidden : 0,
                                   in.topk_idx,
                                   in.topk_weights,
                                   in.tokens,
                                   send_index_,
                                   plan_,
                                   timeout_ns(),
                                   err_dev_,
                                   reused_,
                                   round_ok_};
    transfer_sms_ = in.num_sms;
    // Our own rows go beside the transfer only where that pays: the side stream costs the host
    // five stream and event calls a round. The 128-token decode round is host-bound, and lost
    // 14 us (cached) when every round took them; its own rows copy in a few us after the
    // transfer. The mixed-rounds test runs both kinds.
    beside_ = in.tokens * in.row_bytes >= kBesideBytes;
    if (beside_) UNIEP_CUDA_OK(cudaEventRecord(side_events_[kSlotsReady], stream));
    cuda::launch_transfer(sym_, dims_, transfer_, in.num_sms, stream);
    UNIEP_CUDA_OK(cudaGetLastError());
    if (beside_) UNIEP_CUDA_OK(cudaEventRecord(side_events_[kTransferred], stream));
    return Status::Ok();
  }

  // Until this round's counts are on the host. The notify kernel stores the round's epoch into
  // the host-mapped word after the counts, so the host reads them as soon as they land instead
  // of after a stream synchronize, whose wake-up measured longer than the rest of the wait. A
  // round that fails (a timed-out wait, invalid routing) ends the kernel without that store: the
  // stream's completion ends the spin, and begin_dispatch's checks report why. The kernel's own
  // waits are bounded, so this is too. The stream is queried at most every 50 us: each query is
  // a driver call and a CUDA-profiler event, and one per 64 spins flooded the profiler's trace
  // until parsing it kept a rank away longer than its peers' timeout.
  Status wait_for_counts(cudaStream_t stream) {
    using Clock = std::chrono::steady_clock;
    constexpr auto kQueryEvery = std::chrono::microseconds(50);
    const volatile int64_t* ready = counts_host_ + 1 + 2 * cfg_.world_size + dims_.experts_per_rank;
    Clock::time_point next_query = Clock::now() + kQueryEvery;
    for (uint32_t spin = 1;; ++spin) {
      if (*ready == static_cast<int64_t>(epoch_)) {
        std::atomic_thread_fence(std::memory_order_acquire);
        return Status::Ok();
      }
      if (spin % 64 != 0 || Clock::now() < next_query) continue;
      next_query = Clock::now() + kQueryEvery;
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady)
        return {StatusCode::kInternal,
                detail::str_cat("the stream of notify failed: ", cudaGetErrorString(q))};
    }
  }

  Status ll_checks(int64_t tokens, int buffer) const {
    if (cfg_.ll_max_tokens <= 0)
      return {StatusCode::kInvalidArgument,
              "the low-latency mode needs a runtime created with ll_max_tokens > 0"};
    if (buffer != 0 && buffer != 1)
      return {StatusCode::kInvalidArgument, detail::str_cat("buffer must be 0 or 1, got ", buffer)};
    if (tokens < 0 || tokens > cfg_.ll_max_tokens)
      return {StatusCode::kCapacityExceeded,
              detail::str_cat("x has ", tokens, " tokens but the low-latency buffers hold ",
                              cfg_.ll_max_tokens, " (ll_max_tokens)")};
    return Status::Ok();
  }
  // The row index of the combines ([W * T * K] tagged words, zero = no round yet), allocated by
  // the first combine: rank_partials inverts row_target into it, per_k marks its own rows.
  Status ensure_row_index(cudaStream_t stream) {
    if (row_of_target_ != nullptr) return Status::Ok();
    const size_t bytes =
        sizeof(uint64_t) * cfg_.world_size * cfg_.max_tokens * static_cast<size_t>(cfg_.top_k);
    void* ws = nullptr;
    if (cudaMalloc(&ws, bytes) != cudaSuccess) {
      (void)cudaGetLastError();
      return {StatusCode::kCapacityExceeded,
              detail::str_cat("combine=rank_partials needs ", bytes,
                              " bytes of device memory for its row index; lower max_tokens or "
                              "use combine=per_k")};
    }
    row_of_target_ = static_cast<uint64_t*>(ws);
    UNIEP_CUDA_OK(cudaMemsetAsync(row_of_target_, 0, bytes, stream));
    return Status::Ok();
  }

  // Grid of the copy-out and reduction kernels: a few blocks per SM, to keep bytes in flight.
  int copy_blocks() const { return 4 * sm_count_; }

  Status take_device_error() {
    return runtime::take_device_error(err_host_, [&](const volatile DeviceError& e) -> Status {
      switch (static_cast<cuda::WaitOp>(e.op)) {
        case cuda::WaitOp::kCombineTarget:
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("combine=rank_partials on rank ", cfg_.rank, ": row_target[",
                                  e.have, "] = ", e.want,
                                  " is out of range or repeated; pass the dispatch's row_target "
                                  "(handle.row_target)")};
        case cuda::WaitOp::kCombineMissing:
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("combine=rank_partials on rank ", cfg_.rank,
                                  ": no row of y for receive slot ", e.have, " (from rank ", e.peer,
                                  "), choice k = ", e.want,
                                  "; row_target must name every row of the dispatch")};
        case cuda::WaitOp::kCombineWeights:
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("combine=rank_partials on rank ", cfg_.rank, ": topk_weights[",
                                  e.have, ", ", e.want,
                                  "] differs from the weights the dispatch carried; the expert "
                                  "ranks apply those, so combine must get the same ones (or "
                                  "use combine=per_k)")};
        case cuda::WaitOp::kPlanMismatch:
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("cached dispatch on rank ", cfg_.rank, ": rank ", e.peer,
                                  " passed new routing (topk_idx) in the same round while this "
                                  "rank reused its plan (a handle); every rank must do the same "
                                  "kind of dispatch. Nothing was sent")};
        case cuda::WaitOp::kPeerArgs:
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("cached dispatch on rank ", cfg_.rank, ": rank ", e.peer,
                                  " failed its argument checks in the same round (its error "
                                  "names the argument). Nothing was sent")};
        case cuda::WaitOp::kRoundMismatch:
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("cached dispatch on rank ", cfg_.rank, ": rank ", e.peer,
                                  "'s round differs from rank 0's: ",
                                  describe_round(static_cast<int64_t>(e.have), e.peer), " against ",
                                  describe_round(static_cast<int64_t>(e.want), 0),
                                  "; every rank must dispatch the same row size, precision and "
                                  "combine. Nothing was sent")};
        case cuda::WaitOp::kExpertRows:
          return {StatusCode::kInternal,
                  detail::str_cat("dispatch on rank ", cfg_.rank, ": the received metadata holds ",
                                  e.have, " rows for local expert ", e.peer,
                                  " but its senders announced ", e.want,
                                  " in the count exchange (a peer's buffers were overwritten?); "
                                  "the round's row lists are incomplete")};
        case cuda::WaitOp::kBadExpert: {
          const int64_t entry = static_cast<int64_t>(e.have), K = cfg_.top_k;
          return {StatusCode::kInvalidArgument,
                  detail::str_cat("low-latency dispatch on rank ", cfg_.rank, ": ",
                                  bad_expert_id_message(static_cast<int64_t>(e.want), entry / K,
                                                        entry % K, cfg_.num_experts),
                                  "; that entry was not sent")};
        }
        case cuda::WaitOp::kCapacity:
          return {StatusCode::kCapacityExceeded,
                  detail::str_cat("low-latency dispatch on rank ", cfg_.rank, ": ", e.have,
                                  " rows for one expert of rank ", e.peer, " exceed the region of ",
                                  e.want,
                                  " (ll_max_tokens; an expert repeated within a token's "
                                  "top-k?); nothing of that expert was sent")};
        default:
          break;
      }
      return runtime::wait_timeout(op_name(e.op), cfg_.rank, cfg_.timeout_s, e,
                                   "did every rank of the group call it?");
    });
  }

  Config cfg_;
  runtime::SymmetricHeap heap_;
  SymmetricView sym_{};
  cuda::LowLatencyView ll_{};
  bool ll_pending_[2] = {false, false};
  EpDims dims_{};
  PlanCounts plan_{};
  void* workspace_ = nullptr;
  void* unit_rows_ = nullptr;  // scratch of the row lists (launch_expert_rows)
  int64_t *tokens_per_rank_ = nullptr, *tokens_per_expert_ = nullptr, *send_index_ = nullptr;
  bool* token_in_rank_ = nullptr;
  unsigned long long* layout_error_ = nullptr;
  void* host_ = nullptr;
  DeviceError *err_host_ = nullptr, *err_dev_ = nullptr;
  int64_t *counts_host_ = nullptr, *counts_dev_ = nullptr;
  int64_t* rows_per_local_expert_ = nullptr;
  float* dispatched_weights_ = nullptr;  // [T, K]: the last dispatch's topk_weights
  bool weights_kept_ = false;            // ... when it was made for combine=rank_partials
  CombineReduction round_combine_ = CombineReduction::kPerChoice;  // what this round is for
  int32_t* round_ok_ = nullptr;  // device: the round's notify / reuse barrier verdict
  uint64_t* row_of_target_ = nullptr;
  int sm_count_ = 1;
  cudaStream_t side_ = nullptr;
  enum SideEvent { kSlotsReady, kTransferred, kSideDone, kSideEvents };
  // Rows of x (bytes) from which a round's own rows move on the side stream (start_transfer).
  static constexpr int64_t kBesideBytes = int64_t{4} << 20;
  bool beside_ = false;
  cudaEvent_t side_events_[kSideEvents] = {};
  bool all_peers_mapped_ = false;
  uint64_t epoch_ = 0;
  uint64_t plan_epoch_ = 0;  // the dispatch that made the plan (cached dispatches reuse it)
  bool reused_ = false;      // this round reuses the plan: the dispatch moves rows only
  bool begun_ = false;       // the transfer is enqueued; end_dispatch writes the outputs
  bool dispatched_ = false, combined_ = false;
  cuda::DispatchArgs transfer_{};  // the begun round's, for end_dispatch's kernels
  int transfer_sms_ = 1;
  int64_t last_tokens_ = -1;
  DispatchCounts last_;
};

}  // namespace

Status Config::validate() const {
  auto bad = [](const std::string& m) { return Status{StatusCode::kInvalidArgument, m}; };
  if (max_tokens < 1) return bad(detail::str_cat("max_tokens must be >= 1, got ", max_tokens));
  if (hidden < 1 || hidden % 8 != 0)
    return bad(detail::str_cat("hidden must be a positive multiple of 8, got ", hidden));
  // One warp carries a token's metadata (its source index and K expert ids) in the kernels.
  if (top_k < 1 || top_k > 31)
    return bad(
        detail::str_cat("top_k must be in [1, 31] (a token's index and expert ids fit "
                        "one warp), got ",
                        top_k));
  if (world_size < 1 || world_size > 256)
    return bad(detail::str_cat("world_size must be in [1, 256], got ", world_size));
  if (rank < 0 || rank >= world_size)
    return bad(detail::str_cat("rank must be in [0, ", world_size, "), got ", rank));
  if (num_experts < 1 || num_experts % world_size != 0)
    return bad(detail::str_cat("num_experts (", num_experts,
                               ") must be a positive multiple of the world size (", world_size,
                               ")"));
  if (row_bytes_capacity() % 16 != 0)
    return bad(detail::str_cat("max_row_bytes must be a multiple of 16, got ", max_row_bytes));
  if (!(timeout_s > 0)) return bad(detail::str_cat("timeout_s must be > 0, got ", timeout_s));
  if (ll_max_tokens < 0)
    return bad(detail::str_cat("ll_max_tokens must be >= 0, got ", ll_max_tokens));
  if (num_experts / world_size > cuda::expert_rows_max_experts())
    return bad(detail::str_cat("num_experts / world_size (experts per rank) must be at most ",
                               cuda::expert_rows_max_experts(), ", got ",
                               num_experts / world_size));
  return Status::Ok();
}

size_t symmetric_heap_bytes(const Config& config) {
  return carve(config).total;
}

Status make_unique_id(std::vector<uint8_t>* unique_id) {
  nvshmemx_uniqueid_t id;
  if (nvshmemx_get_uniqueid(&id) != 0)
    return {StatusCode::kInternal, "nvshmemx_get_uniqueid failed"};
  unique_id->resize(sizeof id);
  std::memcpy(unique_id->data(), &id, sizeof id);
  return Status::Ok();
}

Status Runtime::create(const Config& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<Runtime>* runtime) {
  return ::uniep::runtime::create_runtime<RuntimeImpl>(config, unique_id, runtime);
}

}  // namespace uniep::ep
