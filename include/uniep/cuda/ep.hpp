// The expert-parallel runtime on GPUs: NVSHMEM bootstrap, the symmetric buffers, and the
// slot-indexed dispatch and combine of the plan (uniep/plan.hpp) on device pointers.
//
// One Runtime per process group. It is created collectively: rank 0 makes a unique id
// (make_unique_id), the framework broadcasts those bytes, every rank calls create(). No
// launcher of ours is involved. NVLink peers are written with direct stores through
// nvshmem_ptr; other peers through NVSHMEM puts, so several nodes work over NVSHMEM's
// transports.
//
// Every device-side wait is bounded by Config::timeout_s. A timeout sets an error word that the
// host turns into a kTimeout Status naming the operation and the peer that did not answer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "uniep/status.hpp"
#include "uniep/tuning.hpp"

namespace uniep::ep {

struct Config {
  int64_t max_tokens = 0;   // most tokens any rank passes to one dispatch
  int64_t hidden = 0;       // H
  int64_t top_k = 0;        // K
  int64_t num_experts = 0;  // E, split evenly over the ranks
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t max_row_bytes = 0;  // bytes of one dispatched row; 0: hidden * 2 (bf16)
  double timeout_s = 100.0;   // every device-side wait; env UNIEP_TIMEOUT_S overrides the default
  int64_t ll_max_tokens = 0;  // low-latency mode capacity (tokens per rank); 0: no LL buffers

  int64_t row_bytes_capacity() const { return max_row_bytes > 0 ? max_row_bytes : hidden * 2; }
  Status validate() const;
};

// Bytes of NVSHMEM symmetric heap a runtime with this config allocates (before NVSHMEM's own
// reserve); set NVSHMEM_SYMMETRIC_SIZE at least this large before the first create().
size_t symmetric_heap_bytes(const Config& config);

// 128 opaque bytes; only rank 0's are used. Errors come back as a Status, never as an
// exception: this library and its caller may hold different copies of the C++ runtime.
Status make_unique_id(std::vector<uint8_t>* unique_id);

// Counts agreed by all ranks at the start of a dispatch; the host needs them to size outputs.
struct DispatchCounts {
  int64_t num_recv = 0;                      // receive slots on this rank
  std::vector<int64_t> recv_from_rank;       // [W]
  std::vector<int64_t> rows_per_expert;      // [E_local] grouped-GEMM rows of each local expert
  std::vector<int64_t> rows_back_from_rank;  // [W] expert rows each rank returns to us in combine
};

// What a dispatch sends. Device pointers, read by kernels on the dispatch's stream until
// end_dispatch has been enqueued: keep them alive (stream-ordered) until then.
struct DispatchInput {
  // [tokens, row_bytes] (any element type; bytes are copied verbatim), or with fp8: bf16
  // [tokens, hidden], hidden % 128 == 0, cast in the kernel to e4m3 with one fp32 scale per
  // 1x128 block (scale = amax / 448)
  const void* x = nullptr;
  int64_t row_bytes = 0;
  const int64_t* topk_idx = nullptr;    // [tokens, K] int64, global expert ids, -1 unused
  const float* topk_weights = nullptr;  // [tokens, K] float32
  int64_t tokens = 0;
  int num_sms = 0;  // blocks that carry the rows: the communication SM budget
  bool fp8 = false;
  // How this dispatch will be combined; kRankPartials keeps a copy of topk_weights for that
  // combine's check.
  CombineReduction combine = CombineReduction::kPerChoice;
};

// Where a dispatch writes what it received, in slot order = (source rank, token). Sized from
// the DispatchCounts that begin_dispatch returns.
struct DispatchOutput {
  // [num_recv, row_bytes] (fp8: [num_recv, hidden] e4m3 bytes), or nullptr: the rows stay in
  // the runtime's buffer, readable through received_rows() until the next dispatch.
  void* recv_x = nullptr;
  float* recv_scales = nullptr;  // fp8 with recv_x: [num_recv, hidden / 128] float32
  // New routing only, required when num_recv > 0: [num_recv] int64 source token index;
  // [num_recv, K] int64 local expert ids (-1 where the expert is on another rank);
  // [num_recv, K] float32 weights.
  int64_t* recv_src = nullptr;
  int64_t* recv_topk_idx = nullptr;
  float* recv_topk_weights = nullptr;
  // Optional, both or neither (new routing only): for each grouped-GEMM row (local experts in
  // order, each expert's rows in slot order) [R] int64 the slot it reads, and [R] int64 where
  // its output goes back to: src_rank * (max_tokens * K) + src_token * K + k.
  int64_t* row_slot = nullptr;
  int64_t* row_target = nullptr;
};

class Runtime {
 public:
  static Status create(const Config& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<Runtime>* runtime);
  virtual ~Runtime() = default;
  virtual const Config& config() const = 0;
  // True when this runtime initialised NVSHMEM (finalised when the last runtime goes).
  virtual bool owns_nvshmem() const = 0;

  // A dispatch is begin_dispatch (or begin_cached_dispatch), then end_dispatch; each puts every
  // token row into its receive slot on each destination rank (once per rank, however many of its
  // experts live there).
  //
  // begin_dispatch: layout of this rank's routing, the count exchange with every peer, and the
  // transfer of the rows to the peers, all enqueued on `stream`; returns the agreed counts once
  // they are on the host, while the transfer runs, so the caller sizes the outputs meanwhile.
  // A rank whose routing holds an invalid expert id makes every rank return kInvalidArgument
  // (that rank's message names the entry), and nothing is sent. Starts a new epoch. Not
  // capturable in a CUDA graph (kUnsupported): the host reads the counts.
  virtual Status begin_dispatch(const DispatchInput& in, cudaStream_t stream,
                                DispatchCounts* counts) = 0;
  // A round on the plan of the last begin_dispatch, for rows routed exactly as its topk_idx
  // (another tensor of the same tokens, a gradient): no layout, no count exchange and no host
  // sync, only a device-side barrier with every peer. `plan_epoch`: the epoch of a dispatch made
  // on that plan (its handle's). Moves the rows only, into the same slots: the slots' metadata
  // and weights stay the plan dispatch's, so in.topk_idx / in.topk_weights are not read, and
  // end_dispatch needs recv_x and writes nothing else. Every rank must reuse in the same round:
  // a rank that calls begin_dispatch instead gets kInvalidArgument naming the reusing rank, and
  // the reusing rank sends nothing and reports the mismatch through check_device_errors / the
  // next dispatch. Starts a new epoch; `counts` are the plan's. Not capturable in a CUDA graph
  // (kUnsupported): the epoch comes from the host.
  virtual Status begin_cached_dispatch(uint64_t plan_epoch, const DispatchInput& in,
                                       cudaStream_t stream, DispatchCounts* counts) = 0;
  // Writes the outputs of the begun dispatch: this rank's own rows (on SMs beside the transfer),
  // then, once every peer's rows are in, the peers' rows and the metadata.
  virtual Status end_dispatch(const DispatchOutput& out, cudaStream_t stream) = 0;
  // For a caller whose own checks refused a dispatch before begin_dispatch (or
  // begin_cached_dispatch, `cached`) was reached: takes part in the round's exchange with a
  // verdict that fails the round on every rank (their begin_dispatch returns kInvalidArgument
  // naming this rank; a cached round's peers report it through check_device_errors), sends
  // nothing and keeps the epochs in step. begin_* do the same for what they refuse themselves.
  // Every rank's round also carries its row size, precision and combine: a rank whose differ from
  // rank 0's fails the round everywhere, named. Waits (bounded) for the exchange.
  virtual Status fail_round(bool cached, cudaStream_t stream) = 0;
  // What begin_dispatch refuses in its row size, SM budget and precision, for a caller to check
  // before anything else of its own can fail: a rank that fails after starting a round leaves
  // its peers waiting for its rows until their timeout.
  virtual Status check_dispatch_args(int64_t row_bytes, int num_sms, bool fp8) const = 0;

  // Device pointer to the receive buffer of the last dispatch: num_recv rows, each
  // config().row_bytes_capacity() bytes apart (fp8 rows: hidden e4m3 bytes, then the scales).
  virtual const void* received_rows() const = 0;
  // Device [E_local] int64: grouped-GEMM rows per local expert, from the last begin_dispatch.
  virtual const int64_t* rows_per_local_expert() const = 0;
  // The epoch of the last dispatch (begun); a combine names the epoch of the dispatch it answers.
  virtual uint64_t epoch() const = 0;

  // kPerChoice: writes each expert output row y[r] ([R, H] bf16) into slot (token, k) of its
  // source rank, waits for this rank's R_back rows, then out[t] = sum_k w[t,k] * y_(t,k) over
  // valid k in ascending order in fp32, stored as bf16.
  // kRankPartials: each rank sums, per receive slot, its rows in ascending k with the weights
  // the dispatch carried (fp32, rounded once to bf16; on the whole GPU, not num_sms: that reads
  // every expert row) and stores that one row at home, where
  // out[t] = the sum of the token's partials in ascending rank order (fp32). Needs every peer
  // mapped over NVLink and a dispatch made for it (DispatchInput::combine); a row_target that
  // misses or repeats a row, or topk_weights other than the dispatch's, is reported by
  // check_device_errors / the next dispatch. y_fp32 (kRankPartials only): y is [R, H] fp32, the
  // expert outputs as accumulated, so each partial is rounded to bf16 once and the layer keeps
  // kPerChoice's accuracy (bf16 rows rounded and then summed into a rounded partial lose some).
  // topk_idx / topk_weights are this rank's, as given to the matching dispatch. Each dispatch is
  // combined at most once, after its end_dispatch and before the next dispatch: `epoch` must be
  // that dispatch's.
  virtual Status combine(const void* y, const int64_t* row_target, int64_t rows,
                         const int64_t* topk_idx, const float* topk_weights, int64_t tokens,
                         int num_sms, CombineReduction reduction, void* out, uint64_t epoch,
                         cudaStream_t stream, bool y_fp32 = false) = 0;

  // Low-latency mode (decode batches; Config::ll_max_tokens > 0). No count exchange and no host
  // sync, so both calls can be captured in a CUDA graph. Region (local expert e, source rank s)
  // of `buffer` (0 or 1: two rounds may be in flight) holds s's rows for e in (token, k) order:
  //   ll_received_rows(buffer)   [E_local][W * ll_max_tokens] rows, row_bytes_capacity() apart
  //   ll_received_counts(buffer) [E_local][W] int32: rows in each region
  //   ll_received_slots(buffer)  [E_local][W * ll_max_tokens] int64: src_token * K + k
  // valid until the next ll_dispatch on that buffer. x is bf16 [tokens, hidden].
  virtual Status ll_dispatch(const void* x, const int64_t* topk_idx, int64_t tokens, int buffer,
                             cudaStream_t stream) = 0;
  virtual const void* ll_received_rows(int buffer) const = 0;
  virtual const int32_t* ll_received_counts(int buffer) const = 0;
  virtual const int64_t* ll_received_slots(int buffer) const = 0;
  // y: bf16 rows in the dispatch's layout ([E_local][W * ll_max_tokens][hidden]); returns
  // out[t] = sum_k w[t,k] * y_(t,k), k ascending, fp32, as combine() does. Each ll_dispatch of a
  // buffer is combined once (each region's completion word holds one round).
  virtual Status ll_combine(const void* y, const int64_t* topk_idx, const float* topk_weights,
                            int64_t tokens, int buffer, void* out, cudaStream_t stream) = 0;

  // Raises (as a Status) an error a device wait recorded; clears it.
  virtual Status check_device_errors(cudaStream_t stream) = 0;
};

}  // namespace uniep::ep
