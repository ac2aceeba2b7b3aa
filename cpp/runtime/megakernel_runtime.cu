// The fused MoE forward across ranks (uniep/cuda/fused_ep.hpp): one symmetric allocation for the
// GEMM rows, the expert outputs and the counters the peers touch, local buffers for the rest,
// and per call the count exchange, the plan and the persistent kernel on the caller's stream.
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <string>

#include "cuda/megakernel/exchange.hpp"
#include "runtime/nvshmem_session.hpp"
#include "runtime/runtime_support.hpp"
#include "uniep/cuda/fused_ep.hpp"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/fused_moe_backward.hpp"
#include "uniep/cuda/send_rows.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::fused {
namespace {

int64_t counters_of(const Config& c) {
  return c.row_capacity() / c.tile_m + c.num_experts / c.world_size + 1;
}

// Offsets in the symmetric allocation; the same on every rank.
struct Carve {
  size_t arrived;   // uint64 [W]: the epoch each rank last announced here
  size_t counts;    // int64 [2][W][E]: the count matrix of odd and even calls
  size_t counters;  // uint32 [NC]: rows stored per tile (by every rank's send)
  size_t done2;     // uint32 [2][NC]: GEMM 2's finished warps per tile, by call parity
  size_t flags;     // uint32 [T x K]: the backward's return, the epoch each slot last got
  size_t row_src;   // int64 [C]: each GEMM row's source (rank x slots + t x top_k + k)
  size_t rows;      // bf16 [C][H]: the GEMM rows
  size_t combine;   // bf16 [T x K][H]: this rank's entries' expert outputs, slot t x top_k + k
                    // (in a backward call: its entries' input gradients)
  // With Config::backward (else empty):
  size_t rows_go;  // bf16 [C][H]: grad_out's GEMM rows
  size_t row_w;    // fp32 [C]: each GEMM row's routing weight
  size_t dots;     // fp32 [T x K]: each slot's <act, grad_act>
  size_t total;
};

Carve carve(const Config& c) {
  const size_t W = c.world_size, E = c.num_experts, C = c.row_capacity(), H = c.hidden,
               NC = counters_of(c);
  Carve v{};
  runtime::HeapCarver heap;
  v.arrived = heap.take(sizeof(uint64_t) * W);
  v.counts = heap.take(sizeof(int64_t) * 2 * W * E);
  v.counters = heap.take(sizeof(uint32_t) * NC);
  v.done2 = heap.take(sizeof(uint32_t) * 2 * NC);
  const size_t slots = static_cast<size_t>(c.max_tokens) * c.top_k;
  const size_t B = c.backward ? 1 : 0;
  v.flags = heap.take(sizeof(uint32_t) * slots * B);
  v.row_src = heap.take(sizeof(int64_t) * C);
  v.rows = heap.take(C * H * 2);
  v.combine = heap.take(slots * H * 2);
  v.rows_go = heap.take(C * H * 2 * B);
  v.row_w = heap.take(sizeof(float) * C * B);
  v.dots = heap.take(sizeof(float) * slots * B);
  v.total = heap.total();
  return v;
}

class RuntimeImpl final : public Runtime {
 public:
  explicit RuntimeImpl(const Config& c)
      : cfg_(c), layout_(carve(c)), capacity_(c.row_capacity()), num_counters_(counters_of(c)) {}
  ~RuntimeImpl() override {
    // nvshmem_free is collective: every rank destroys its runtime together
    // (uniep.moe.megakernel.launch.shutdown_fused_ep), never from a static destructor.
    cudaDeviceSynchronize();
    heap_.close();
    if (local_) cudaFree(local_);
  }

  Status init(const std::vector<uint8_t>& uid) {
    if (Status s =
            heap_.open(uid, cfg_.world_size, cfg_.rank, layout_.total, " for the fused MoE runtime",
                       "lower max_tokens or set NVSHMEM_SYMMETRIC_SIZE to at least the sum "
                       "of the UniEP runtimes' symmetric_heap_bytes before the first one "
                       "is created");
        !s.ok())
      return s;
    if (Status s = heap_.map_peers(peer_, "the fused MoE kernel needs",
                                   "use moe_forward (overlap=sequential) across nodes");
        !s.ok())
      return s;
    // The words peers add to or wait on must read zero everywhere before any peer may touch them.
    UNIEP_CUDA_OK(cudaMemset(heap_.base(), 0, layout_.row_src));

    const int64_t T = cfg_.max_tokens, K = cfg_.top_k, El = cfg_.num_experts / cfg_.world_size;
    int device = 0;
    UNIEP_CUDA_OK(cudaGetDevice(&device));
    UNIEP_CUDA_OK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    device_ = device;
    workspace_bytes_ = cuda::fused_moe_workspace_bytes(El, sm_count_);
    if (cfg_.backward)
      workspace_bytes_ =
          std::max(workspace_bytes_, cuda::fused_moe_backward_workspace_bytes(El, sm_count_));
    runtime::HeapCarver local;  // the same alignment for the local buffers
    const size_t act = local.take(static_cast<size_t>(capacity_) * cfg_.ffn * 2);
    const size_t done1 = local.take(sizeof(uint32_t) * num_counters_);
    const size_t plan = local.take(sizeof(int64_t) * 4 * std::max<int64_t>(T * K, 1));
    const size_t offs = local.take(sizeof(int32_t) * El);
    const size_t base = local.take(sizeof(int32_t) * (El + 1));
    const size_t weights = local.take(sizeof(float) * K);
    const size_t table = local.take(sizeof(void*) * cuda::kMaxFusedPeers);
    const size_t epoch_word = local.take(sizeof(uint64_t));
    const size_t counts_now = local.take(sizeof(int64_t) * cfg_.world_size * cfg_.num_experts);
    const size_t ws = local.take(workspace_bytes_);
    UNIEP_CUDA_OK(cudaMalloc(&local_, local.total()));
    auto* l = static_cast<uint8_t*>(local_);
    act_ = l + act;
    done1_ = reinterpret_cast<uint32_t*>(l + done1);
    dest_rank_ = reinterpret_cast<int64_t*>(l + plan);
    gemm_row_ = dest_rank_ + std::max<int64_t>(T * K, 1);
    counter_ = gemm_row_ + std::max<int64_t>(T * K, 1);
    send_order_ = counter_ + std::max<int64_t>(T * K, 1);
    offs_ = reinterpret_cast<int32_t*>(l + offs);
    tile_base_ = reinterpret_cast<int32_t*>(l + base);
    no_weights_ = reinterpret_cast<float*>(l + weights);
    workspace_ = l + ws;
    combine_table_ = reinterpret_cast<void**>(l + table);
    epoch_word_ = reinterpret_cast<uint64_t*>(l + epoch_word);
    counts_now_ = reinterpret_cast<int64_t*>(l + counts_now);
    UNIEP_CUDA_OK(cudaMemset(epoch_word_, 0, sizeof(uint64_t)));
    void* combine[cuda::kMaxFusedPeers] = {};
    for (int64_t p = 0; p < cfg_.world_size; ++p) combine[p] = peer_[p] + layout_.combine;
    UNIEP_CUDA_OK(cudaMemcpy(combine_table_, combine, sizeof combine, cudaMemcpyHostToDevice));
    UNIEP_CUDA_OK(cudaMemset(no_weights_, 0, sizeof(float) * K));
    return heap_.barrier();
  }

  const Config& config() const override { return cfg_; }
  uint64_t epoch() const override { return epoch_; }

  Status forward(const ForwardArgs& f, const cuda::FusedMoeLaunch& launch,
                 cudaStream_t stream) override {
    if (Status s = check_tokens(f.tokens); !s.ok()) return s;
    if (f.tokens > 0 &&
        (f.x == nullptr || f.topk_idx == nullptr || f.topk_weights == nullptr || f.out == nullptr))
      return {StatusCode::kInvalidArgument,
              "x, topk_idx, topk_weights and out must be device pointers"};
    if (f.w1_packed == nullptr || f.w2 == nullptr || f.error == nullptr || f.timeout == nullptr)
      return {StatusCode::kInvalidArgument,
              "w1_packed, w2, error and timeout must be device pointers"};
    const int64_t W = cfg_.world_size, El = cfg_.num_experts / W, K = cfg_.top_k;
    auto at = [&](int64_t p, size_t off) { return peer_[p] + off; };
    auto* mine = heap_.base();
    auto* counters = reinterpret_cast<uint32_t*>(mine + layout_.counters);
    auto* done2 = reinterpret_cast<uint32_t*>(mine + layout_.done2);  // parity 0's set
    // Fewer senders than CTAs overlap the send with the GEMMs, in the order the GEMMs take rows.
    const bool ordered = W > 1 && launch.comm_ctas < sm_count_;
    if (Status s =
            begin_call(f.topk_idx, f.tokens, cfg_.tile_m, ordered, f.error, f.timeout, stream);
        !s.ok())
      return s;

    cuda::FusedMoeArgs a;
    // A rank with no tokens still runs the kernel (its experts get peers' rows); its own
    // pointers are never read then, but must be valid.
    const bool none = f.tokens == 0;
    a.x = none ? mine + layout_.rows : f.x;
    a.tokens = f.tokens;
    a.hidden = cfg_.hidden;
    a.top_k = K;
    a.topk_weights = none ? no_weights_ : f.topk_weights;
    a.gemm_row = gemm_row_;
    a.counter = counter_;
    a.dest_rank = dest_rank_;
    a.send_order = ordered ? send_order_ : nullptr;
    a.w1_packed = f.w1_packed;
    a.w1_as_stored = f.w1_as_stored;
    a.w2 = f.w2;
    a.num_experts = El;
    a.ffn = cfg_.ffn;
    a.offs = offs_;
    a.tile_base = tile_base_;
    a.capacity = capacity_;
    a.rows = mine + layout_.rows;
    a.act = act_;
    a.y = W == 1 ? mine + layout_.combine : nullptr;  // one rank: its slots are y (below)
    a.out = none ? mine + layout_.rows : f.out;
    a.counters = counters;
    a.done1 = done1_;
    a.done2 = done2;
    a.parity_epoch = epoch_word_;
    a.done2_parity_stride = num_counters_;
    a.num_counters = num_counters_;
    a.error = f.error;
    a.timeout = f.timeout;
    a.timeout_ns = timeout_ns();
    a.trace = f.trace;
    a.gate_wait_ns = f.gate_wait_ns;
    a.peers.world_size = static_cast<int>(W);
    a.peers.rank = static_cast<int>(cfg_.rank);
    a.peers.slots_per_rank = cfg_.max_tokens * K;
    for (int64_t p = 0; p < W; ++p) {
      a.peers.rows[p] = at(p, layout_.rows);
      a.peers.row_src[p] = reinterpret_cast<int64_t*>(at(p, layout_.row_src));
      a.peers.counters[p] = reinterpret_cast<uint32_t*>(at(p, layout_.counters));
      a.peers.combine[p] = at(p, layout_.combine);
      a.peers.done2[p] = reinterpret_cast<const uint32_t*>(at(p, layout_.done2));
    }
    a.peers.combine_table = combine_table_;
    if (W == 1) {
      // One rank: the kernel's own single-rank path, in token order, its outputs in y (the
      // slots' memory: the rows never exceed max_tokens x top_k there).
      a.peers = cuda::FusedPeers{};
      a.row_entry = nullptr;
    }
    cuda::FusedMoeLaunch l = launch;
    l.tile_m = cfg_.tile_m;  // the plan above counts tiles of this height
    if (W == 1) l.comm_ctas = std::max(l.comm_ctas, sm_count_);  // token order needs no inverse
    return cuda::moe_fused_forward_bf16(a, l, device_, workspace_, workspace_bytes_, stream);
  }

  Status backward_rows(const BackwardArgs& b, BackwardRows* rows, cudaStream_t stream) override {
    if (!cfg_.backward)
      return {StatusCode::kInvalidArgument,
              "this fused MoE runtime was created without the backward's buffers: create it "
              "with backward=True (uniep.moe.megakernel.launch.init_fused_ep)"};
    if (Status s = check_tokens(b.tokens); !s.ok()) return s;
    if (b.tokens > 0 && (b.x == nullptr || b.grad_out == nullptr || b.topk_idx == nullptr ||
                         b.topk_weights == nullptr))
      return {StatusCode::kInvalidArgument,
              "x, grad_out, topk_idx and topk_weights must be device pointers"};
    if (b.w1 == nullptr || b.w2t == nullptr || b.h == nullptr || b.grad_act == nullptr ||
        b.error == nullptr || b.timeout == nullptr || rows == nullptr)
      return {StatusCode::kInvalidArgument,
              "w1, w2t, h, grad_act, error, timeout and rows must be device pointers"};
    const int64_t W = cfg_.world_size, El = cfg_.num_experts / W, K = cfg_.top_k;
    // The gated GEMM's tiles (kGatedTileM rows): at most the counters the forward's height needs.
    if (Status s =
            begin_call(b.topk_idx, b.tokens, cuda::kGatedTileM, false, b.error, b.timeout, stream);
        !s.ok())
      return s;
    auto* mine = heap_.base();
    const bool none = b.tokens == 0;  // its own pointers are never read, but must be valid
    cuda::FusedBackwardArgs a;
    a.x = none ? mine + layout_.rows : b.x;
    a.grad_out = none ? mine + layout_.rows : b.grad_out;
    a.tokens = b.tokens;
    a.hidden = cfg_.hidden;
    a.top_k = K;
    a.gemm_row = gemm_row_;
    a.counter = counter_;
    a.w1 = b.w1;
    a.w2t = b.w2t;
    a.num_experts = El;
    a.ffn = cfg_.ffn;
    a.offs = offs_;
    a.tile_base = tile_base_;
    a.capacity = capacity_;
    a.rows_x = mine + layout_.rows;
    a.rows_go = mine + layout_.rows_go;
    a.h = b.h;
    a.grad_act = b.grad_act;
    a.counters = reinterpret_cast<uint32_t*>(mine + layout_.counters);
    a.num_counters = num_counters_;
    a.error = b.error;
    a.timeout = b.timeout;
    a.timeout_ns = timeout_ns();
    a.trace = b.trace;
    a.dest_rank = dest_rank_;
    a.topk_weights = none ? no_weights_ : b.topk_weights;
    a.peers.world_size = static_cast<int>(W);
    a.peers.rank = static_cast<int>(cfg_.rank);
    a.peers.slots_per_rank = cfg_.max_tokens * K;
    for (int64_t p = 0; p < W; ++p) {
      a.peers.rows_x[p] = peer_[p] + layout_.rows;
      a.peers.rows_go[p] = peer_[p] + layout_.rows_go;
      a.peers.row_src[p] = reinterpret_cast<int64_t*>(peer_[p] + layout_.row_src);
      a.peers.row_w[p] = reinterpret_cast<float*>(peer_[p] + layout_.row_w);
      a.peers.counters[p] = reinterpret_cast<uint32_t*>(peer_[p] + layout_.counters);
    }
    // At one rank too: the send then writes the sources and weights the return reads.
    if (Status s = cuda::moe_fused_backward_rows_bf16(a, sm_count_, device_, workspace_,
                                                      workspace_bytes_, stream);
        !s.ok())
      return s;
    rows->rows_x = mine + layout_.rows;
    rows->rows_go = mine + layout_.rows_go;
    rows->row_w = reinterpret_cast<const float*>(mine + layout_.row_w);
    rows->offs = offs_;
    rows->capacity = capacity_;
    return Status::Ok();
  }

  Status backward_return(const ReturnArgs& r, cudaStream_t stream) override {
    if (!cfg_.backward)
      return {StatusCode::kInvalidArgument,
              "this fused MoE runtime was created without the backward's buffers"};
    if (Status s = check_tokens(r.tokens); !s.ok()) return s;
    const int64_t W = cfg_.world_size, El = cfg_.num_experts / W;
    auto* mine = heap_.base();
    cuda::FusedReturnArgs a;
    a.grad_rows = r.grad_rows;
    a.dots = r.dots;
    a.row_src = reinterpret_cast<const int64_t*>(mine + layout_.row_src);
    a.rows_end = offs_ + (El - 1);
    a.capacity = capacity_;
    a.hidden = cfg_.hidden;
    a.gemm_row = gemm_row_;
    a.tokens = r.tokens;
    a.top_k = cfg_.top_k;
    a.grad_x = r.grad_x;
    a.grad_w = r.grad_w;
    a.world_size = static_cast<int>(W);
    a.rank = static_cast<int>(cfg_.rank);
    a.slots_per_rank = cfg_.max_tokens * cfg_.top_k;
    for (int64_t p = 0; p < W; ++p) {
      a.slots[p] = peer_[p] + layout_.combine;
      a.slot_dots[p] = reinterpret_cast<float*>(peer_[p] + layout_.dots);
      a.slot_flag[p] = reinterpret_cast<uint32_t*>(peer_[p] + layout_.flags);
    }
    a.epoch_word = epoch_word_;
    a.error = r.error;
    a.timeout = r.timeout;
    a.timeout_ns = timeout_ns();
    return cuda::moe_fused_backward_return_bf16(a, sm_count_, stream);
  }

 private:
  uint64_t timeout_ns() const { return static_cast<uint64_t>(cfg_.timeout_s * 1e9); }

  // Every call's token count: the buffers hold max_tokens of them.
  Status check_tokens(int64_t tokens) const {
    if (tokens >= 0 && tokens <= cfg_.max_tokens) return Status::Ok();
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat("tokens must be in [0, max_tokens = ", cfg_.max_tokens, "], got ", tokens)};
  }

  // The count exchange, this call's plan (tiles of tile_m rows; with `ordered` also the send
  // order) and the local experts' tile bases: the start of every call, forward or backward.
  Status begin_call(const int64_t* topk_idx, int64_t tokens, int tile_m, bool ordered,
                    unsigned long long* error, cuda::GateTimeout* timeout, cudaStream_t stream) {
    // The call's epoch and parity live on the device (epoch_word_, advanced by the exchange
    // kernel), so a CUDA graph of this call replays as a new call each time; nothing below
    // depends on the parity on the host.
    const int64_t W = cfg_.world_size, E = cfg_.num_experts, El = E / W, K = cfg_.top_k;
    auto* mine = heap_.base();
    cuda::FusedExchangeArgs x;
    x.topk_idx = topk_idx;
    x.tokens = tokens;
    x.top_k = K;
    x.num_experts = E;
    x.world_size = static_cast<int>(W);
    x.rank = static_cast<int>(cfg_.rank);
    x.epoch_word = epoch_word_;
    x.counts_parity_stride = W * E;
    for (int64_t p = 0; p < W; ++p) {
      x.peer_counts[p] = reinterpret_cast<int64_t*>(peer_[p] + layout_.counts);
      x.peer_arrived[p] = reinterpret_cast<uint64_t*>(peer_[p] + layout_.arrived);
    }
    // Zeroed by the exchange before this rank announces the call: peers only touch them after.
    x.zero_always[0] = reinterpret_cast<uint32_t*>(mine + layout_.counters);
    x.zero_always[1] = done1_;
    x.zero_by_parity = reinterpret_cast<uint32_t*>(mine + layout_.done2);
    x.zero_count = num_counters_;
    x.counts_out = counts_now_;
    x.offs = offs_;
    x.timeout = timeout;
    x.timeout_ns = timeout_ns();
    if (Status s = cuda::fused_exchange_counts(x, stream); !s.ok()) return s;
    // From here on every peer waits for this rank's rows: the call is under way.
    ++epoch_;

    cuda::SenderRowsPlanArgs plan;
    plan.topk_idx = topk_idx;
    plan.tokens = tokens;
    plan.top_k = K;
    plan.counts = counts_now_;
    plan.counts_ld = E;
    plan.world_size = W;
    plan.rank = cfg_.rank;
    plan.num_experts = E;
    plan.tile_m = tile_m;
    plan.dest_rank = dest_rank_;
    plan.gemm_row = gemm_row_;
    plan.counter = counter_;
    plan.error = error;
    if (ordered) {
      UNIEP_CUDA_OK(cudaMemsetAsync(send_order_, 0xff, sizeof(int64_t) * tokens * K, stream));
      plan.send_order = send_order_;
    }
    if (Status s = cuda::plan_sender_rows_async(plan, stream); !s.ok()) return s;
    return cuda::gate_tile_base(offs_, El, capacity_, tile_m, tile_base_, stream);
  }

  Config cfg_;
  Carve layout_;
  int64_t capacity_ = 0, num_counters_ = 0;
  runtime::SymmetricHeap heap_;
  uint8_t* peer_[cuda::kMaxFusedPeers] = {};
  int device_ = 0, sm_count_ = 0;
  void* local_ = nullptr;
  uint8_t* act_ = nullptr;
  uint32_t* done1_ = nullptr;
  int64_t *dest_rank_ = nullptr, *gemm_row_ = nullptr, *counter_ = nullptr, *send_order_ = nullptr;
  int32_t *offs_ = nullptr, *tile_base_ = nullptr;
  float* no_weights_ = nullptr;
  void** combine_table_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  uint64_t* epoch_word_ = nullptr;  // the device's count of calls (fused_exchange_counts)
  int64_t* counts_now_ = nullptr;   // [W][E] this call's count matrix, for the plan
  uint64_t epoch_ = 0;              // calls enqueued from the host (a graph replay adds none)
};

}  // namespace

// A token's top-k may name one expert more than once (each (t, k) is a GEMM row of its own), so
// a rank may receive all top_k rows of every token, however few experts it holds.
int64_t Config::row_capacity() const {
  return world_size * max_tokens * top_k;
}

Status Config::validate() const {
  auto bad = [](const std::string& m) { return Status{StatusCode::kInvalidArgument, m}; };
  if (world_size < 1 || world_size > cuda::kMaxFusedPeers)
    return bad(detail::str_cat("world_size must be in [1, ", cuda::kMaxFusedPeers,
                               "] (one NVLink domain), got ", world_size));
  if (rank < 0 || rank >= world_size)
    return bad(detail::str_cat("rank must be in [0, ", world_size, "), got ", rank));
  if (max_tokens < 1) return bad(detail::str_cat("max_tokens must be >= 1, got ", max_tokens));
  if (hidden < 64 || hidden % 64 != 0)
    return bad(detail::str_cat("hidden must be a positive multiple of 64, got ", hidden));
  if (ffn < 64 || ffn % 64 != 0)
    return bad(detail::str_cat("ffn must be a positive multiple of 64, got ", ffn));
  if (top_k < 1 || top_k > 32) return bad(detail::str_cat("top_k must be in [1, 32], got ", top_k));
  if (num_experts < 1 || num_experts > kMaxExperts || num_experts % world_size != 0)
    return bad(detail::str_cat("num_experts must be a multiple of world_size (", world_size,
                               ") in [1, ", kMaxExperts, "], got ", num_experts));
  if (top_k > num_experts)
    return bad(
        detail::str_cat("top_k (", top_k, ") must be at most num_experts (", num_experts, ")"));
  if (!(timeout_s > 0)) return bad(detail::str_cat("timeout_s must be > 0, got ", timeout_s));
  if (tile_m != 128 && tile_m != 64)
    return bad(
        detail::str_cat("tile_m must be 128 or 64 (the fused kernel's tile rows), got ", tile_m));
  if (row_capacity() > (int64_t{1} << 31) - 1)
    return bad(detail::str_cat("world_size x max_tokens x top_k = ", row_capacity(),
                               " GEMM rows exceed 2^31 - 1: lower max_tokens"));
  return Status::Ok();
}

size_t symmetric_heap_bytes(const Config& config) {
  return carve(config).total;
}

Status Runtime::create(const Config& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<Runtime>* runtime) {
  return runtime::create_runtime<RuntimeImpl>(config, unique_id, runtime);
}

}  // namespace uniep::fused
