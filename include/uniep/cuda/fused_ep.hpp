// The MoE MegaKernel across ranks (docs/megakernel.md): the runtime that runs the fused forward
// of fused_moe.hpp with expert parallelism, every rank of the group on one NVLink domain.
//
// Per call, on the caller's stream and with no host sync:
//   1. the count exchange: each rank counts its (token, k) entries per global expert and stores
//      that row into every peer's [W][E] matrix (two, by call parity), then its epoch into each
//      peer's arrival word; it waits (bounded) for every peer's epoch;
//   2. the plan (plan_sender_rows_async on that matrix): each entry's destination rank, its GEMM
//      row there (expert-contiguous, and within an expert by source rank, then token order: a
//      function of the routing alone) and that row's tile counter there; and this rank's expert
//      row ranges and tile bases;
//   3. the persistent kernel: every CTA stores its share of the tokens' rows straight into the
//      destination ranks' GEMM rows (nvshmem_ptr mappings), with each row's source, and counts
//      them on their tile gates; the local experts' two GEMMs run gated tile by tile on the rows
//      that arrive, GEMM 2's epilogue storing each output row straight into its source rank's
//      combine slot (token, k); and every CTA's warps then take this rank's tokens in turn and
//      reduce each from its own slots once the expert's rank has signalled the tile that wrote it.
// The output bits equal the world-1 kernel's on the same tokens with every expert's weights (a
// row's GEMM arithmetic does not depend on the tile it shares; the reduce is the same ascending-k
// fp32 sum), whatever the arrival order.
//
// Reuse without barriers: what peers write into a rank during call n (rows, sources, combine
// slots, counters) is written before their call n ends, which is before they join exchange
// n + 1, which this rank waits for before call n + 1 reuses them; the done counters peers read
// come in two sets by parity, each zeroed by its rank before its exchange. Ranks stay at most
// one call apart.
//
// The call count (the epoch the exchange announces) and so the parity live on the device: the
// exchange kernel reads, advances and writes back the rank's epoch word and zeroes the call's
// counters itself, and the kernels pick the parity's counters on the device. So a call captured
// in a CUDA graph is a new call at every replay (decode steps), as long as every rank replays
// its graphs and makes its eager calls in the same order.
//
// The backward (backward_rows, then the caller's element-wise pass and data-gradient GEMM, then
// backward_return) is a call of the same kind: its own exchange and plan, the rows of x and
// grad_out sent to the experts' ranks inside one launch that runs h and grad_act gated on them,
// and the rows' gradients stored back into their sources' slots, each flagged with the call's
// epoch, before each source reduces its tokens (docs/megakernel.md, "The fused backward").
//
// Symmetric memory: capacity x (hidden bf16 + 8 bytes) of GEMM rows and their sources, capacity
// = world x max_tokens x top_k, the most rows any rank can receive (a token's top-k may name one
// expert more than once, each (t, k) a row of its own; so no row is ever dropped), max_tokens x
// top_k x hidden bf16 of combine slots, and the counters; with Config::backward also capacity x
// (hidden bf16 + 4 bytes) for grad_out's rows and the rows' weights, and 8 bytes per slot for
// the dots and flags.
// Every device wait is bounded by timeout_s; a timeout is recorded (GateTimeout: flag 4 the count
// exchange, naming the rank that did not arrive; 1 and 3 the GEMM's rows and the reduce's
// outputs) and returned, never a hang; once one wait has given up, the others of the launch do.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/tile_gate.hpp"
#include "uniep/status.hpp"

namespace uniep::fused {

struct Config {
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t max_tokens = 0;   // most tokens any rank passes to one call
  int64_t hidden = 0;       // a multiple of 64
  int64_t ffn = 0;          // the experts' intermediate size, a multiple of 64
  int64_t top_k = 0;        // in [1, 32]
  int64_t num_experts = 0;  // global, a multiple of world_size, at most kMaxExperts
  double timeout_s = 100.0;
  // The fused kernel's tile rows (cuda::FusedMoeLaunch::tile_m): 128 or 64. Part of the config
  // because every rank must plan its rows to a peer's tiles of the peer's height.
  int tile_m = 128;
  // Whether the runtime also holds the fused backward's buffers (Runtime::backward_rows): a
  // second row buffer for grad_out's rows, each row's routing weight, and the return's dots and
  // flags per slot; about one more row buffer of symmetric heap.
  bool backward = false;

  // Rows of each rank's GEMM buffers: world x max_tokens x top_k.
  int64_t row_capacity() const;
  Status validate() const;
};

// The count exchange keeps a block's counts in shared memory.
constexpr int64_t kMaxExperts = 4096;

// Bytes of NVSHMEM symmetric heap a runtime with this config allocates; set
// NVSHMEM_SYMMETRIC_SIZE at least this large (plus the other runtimes') before the first UniEP
// runtime initialises NVSHMEM, or create this one first when it is the process's only one.
size_t symmetric_heap_bytes(const Config& config);

// One call's operands: device pointers on this rank.
struct ForwardArgs {
  const void* x = nullptr;              // [tokens][hidden] bf16
  const int64_t* topk_idx = nullptr;    // [tokens][top_k] global expert ids, -1 unused
  const float* topk_weights = nullptr;  // [tokens][top_k]
  int64_t tokens = 0;                   // <= max_tokens; 0 is valid (the rank still computes)
  const void* w1_packed = nullptr;      // [E / W][hidden][2 x ffn] bf16 (pack_gate_up's layout)
  bool w1_as_stored = false;  // w1_packed is w1 as stored instead (FusedMoeArgs::w1_as_stored)
  const void* w2 = nullptr;             // [E / W][ffn][hidden] bf16
  void* out = nullptr;                  // [tokens][hidden] bf16
  // Written by the device, zeroed by the caller: a plan, send or reduce error
  // (send_rows_error.hpp) and the first wait that timed out.
  unsigned long long* error = nullptr;
  cuda::GateTimeout* timeout = nullptr;
  unsigned long long* trace = nullptr;  // optional, as FusedMoeArgs::trace
  unsigned long long* gate_wait_ns = nullptr;  // optional, as FusedMoeArgs::gate_wait_ns
};

// The fused backward's first step (docs/megakernel.md, "The fused backward"): the same count
// exchange and plan as a forward call (a call of its own, with the forward's routing), then one
// persistent launch per rank (moe_fused_backward_rows_bf16 with peers) that stores this rank's
// x and grad_out rows into their experts' ranks' GEMM rows, with each row's source slot and
// routing weight, and runs this rank's h = rows_x w1 and grad_act = rows_go w2t gated on them.
struct BackwardArgs {
  const void* x = nullptr;              // [tokens][hidden] bf16, the forward's input
  const void* grad_out = nullptr;       // [tokens][hidden] bf16
  const int64_t* topk_idx = nullptr;    // [tokens][top_k], the forward's
  const float* topk_weights = nullptr;  // [tokens][top_k]
  int64_t tokens = 0;                   // <= max_tokens; 0 is valid (the rank still computes)
  const void* w1 = nullptr;   // [E / W][hidden][2 x ffn] bf16, gate columns then up (not packed)
  const void* w2t = nullptr;  // [E / W][hidden][ffn] bf16: w2 transposed
  void* h = nullptr;          // [row_capacity][2 x ffn] bf16, written (rows in use only)
  void* grad_act = nullptr;   // [row_capacity][ffn] bf16, written (rows in use only)
  unsigned long long* error = nullptr;  // zeroed by the caller, as ForwardArgs::error
  cuda::GateTimeout* timeout = nullptr;  // zeroed by the caller
  unsigned long long* trace = nullptr;   // optional, as cuda::FusedBackwardArgs::trace
};

// This rank's rows of the call, in the runtime's buffers, valid until its next call: the
// element-wise pass, grad_rows = grad_h w1^T and the weight gradients run on them.
struct BackwardRows {
  const void* rows_x = nullptr;   // [capacity][hidden] bf16
  const void* rows_go = nullptr;  // [capacity][hidden] bf16
  const float* row_w = nullptr;   // [capacity] each row's routing weight
  const int32_t* offs = nullptr;  // [E / W] cumulative row ends of the local experts
  int64_t capacity = 0;           // row_capacity()
};

// The last step: each row's input gradient and <act, grad_act> back to its source slot (t, k),
// and this rank's reduce over k with unit weights (moe_fused_backward_return_bf16).
struct ReturnArgs {
  const void* grad_rows = nullptr;  // [row_capacity][hidden] bf16: grad_h w1^T of the rows
  const float* dots = nullptr;      // [row_capacity]
  int64_t tokens = 0;               // as in the call's BackwardArgs
  void* grad_x = nullptr;           // [tokens][hidden] bf16
  float* grad_w = nullptr;          // [tokens][top_k], 0 for unused entries
  unsigned long long* error = nullptr;
  cuda::GateTimeout* timeout = nullptr;  // flag 3: a slot that never came back
};

class Runtime {
 public:
  // Collective: every rank creates its runtime with the same config but its rank, from rank 0's
  // unique id (ep::make_unique_id; NVSHMEM is shared with the other UniEP runtimes).
  static Status create(const Config& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<Runtime>* runtime);
  virtual ~Runtime() = default;
  virtual const Config& config() const = 0;
  // Enqueues one call on `stream` (every rank calls it, in the same order). Launch: the tuning
  // point (comm_ctas >= the SM count: every CTA sends).
  virtual Status forward(const ForwardArgs& args, const cuda::FusedMoeLaunch& launch,
                         cudaStream_t stream) = 0;
  // The backward of a forward call on the same routing: backward_rows, then on the same stream
  // the caller's element-wise pass and data-gradient GEMM over `rows`, then backward_return
  // (one call of the group, which every rank makes in the same order; the weight gradients may
  // follow the return but must run before this rank's next call, which reuses the rows).
  // kInvalidArgument on a runtime created without Config::backward.
  virtual Status backward_rows(const BackwardArgs& args, BackwardRows* rows,
                               cudaStream_t stream) = 0;
  virtual Status backward_return(const ReturnArgs& args, cudaStream_t stream) = 0;
  virtual uint64_t epoch() const = 0;  // calls enqueued from the host (graph replays add none)
};

}  // namespace uniep::fused
