// The MegaKernel's dispatch (docs/megakernel.md): each (token, k) row is stored by its sender
// straight into its grouped-GEMM row on the destination rank, and every stored row adds 1 to
// that row's tile gate counter there (include/uniep/cuda/tile_gate.hpp), so a gated GEMM starts
// on a tile as soon as its last row has landed. Where each row goes follows from the routing and
// the agreed counts alone (uniep::plan_sender_rows in uniep/plan.hpp is the CPU reference), so
// the rows' places never depend on arrival order.
//
// Plain device pointers. Peers are reached through pointers the caller resolved (nvshmem_ptr
// for NVLink peers, the rank's own buffers for itself) with ordinary stores and system-scope
// atomics: no NVSHMEM device call, so these kernels can live in the GEMMs' non-relocatable code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "uniep/send_rows_error.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

// plan_sender_rows on the device: one block per global expert.
struct SenderRowsPlanArgs {
  const int64_t* topk_idx = nullptr;  // [tokens][top_k] global expert ids, -1: unused
  int64_t tokens = 0, top_k = 0;
  // counts[s * counts_ld + g]: rows rank s routes to global expert g, as every rank agreed
  // ([W][E] with counts_ld = E, or the count exchange's matrix with its own stride)
  const int64_t* counts = nullptr;
  int64_t counts_ld = 0;
  int64_t world_size = 1, rank = 0, num_experts = 0;
  int tile_m = 128;
  int64_t* dest_rank = nullptr;  // [tokens * top_k] outputs, -1 for unused entries
  int64_t* gemm_row = nullptr;
  int64_t* counter = nullptr;
  unsigned long long* error = nullptr;  // zeroed by the caller
  // Optional [tokens * top_k], filled with -1 by the caller: this rank's entries in the order a
  // send that overlaps the GEMMs stores them, by (expert index on its rank, rank, row), so that
  // every rank's first experts are complete first; the scheduler takes them first. The rank's
  // routed entries come first, -1 after them.
  int64_t* send_order = nullptr;
};
Status plan_sender_rows_async(const SenderRowsPlanArgs& a, cudaStream_t stream);

// The whole plan of a call at world 1 (every expert on this GPU), no host sync: expert_tiles'
// counts [E] int64, offs [E] int32 and tile_base [E + 1] int32 (uniep/cuda/tile_gate.hpp), and
// plan_sender_rows_async's dest_rank, gemm_row and counter (rank 0, those counts), with the same
// values. Up to 1,024 experts it is a memset and two launches: the counts, then each block's
// entries ranked by a counting sort; past that the counts and the plan kernel above, whose
// blocks each walk every id. `error` is zeroed by the call (not by the caller, as
// plan_sender_rows_async's); a failing entry (an id outside [-1, E)) is recorded as by
// plan_sender_rows_async.
struct LocalPlanArgs {
  const int64_t* topk_idx = nullptr;  // [tokens][top_k] expert ids, -1: unused
  int64_t tokens = 0, top_k = 0, num_experts = 0;
  int tile_m = 128;
  int64_t* counts = nullptr;
  int32_t* offs = nullptr;
  int32_t* tile_base = nullptr;
  int64_t* dest_rank = nullptr;  // [tokens * top_k], -1 for unused entries
  int64_t* gemm_row = nullptr;
  int64_t* counter = nullptr;
  unsigned long long* error = nullptr;
};
// Device memory the call uses until the stream has run it (any contents).
size_t local_plan_workspace_bytes(int64_t entries, int64_t num_experts);
Status plan_local_rows_async(const LocalPlanArgs& a, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream);

// The destinations a send may write: row r of rank d at rows[d] + r * row_stride, its gate
// counters at counters[d]. The same capacities on every rank (symmetric buffers).
constexpr int kMaxRowPeers = 64;
struct RowPeers {
  uint8_t* rows[kMaxRowPeers] = {};
  uint32_t* counters[kMaxRowPeers] = {};
  int num_peers = 0;
  int64_t row_stride = 0;     // bytes, a multiple of 16
  int64_t rows_capacity = 0;  // rows of each destination
  int64_t num_counters = 0;   // counters of each destination
};

struct SendRowsArgs {
  const void* x = nullptr;  // [tokens] rows of row_bytes, x_stride bytes apart
  int64_t x_stride = 0;
  int64_t row_bytes = 0;  // a multiple of 16, at most the peers' row_stride
  int64_t tokens = 0, top_k = 0;
  const int64_t* dest_rank = nullptr;  // [tokens * top_k] from plan_sender_rows
  const int64_t* gemm_row = nullptr;
  const int64_t* counter = nullptr;
  unsigned long long* error = nullptr;  // zeroed by the caller
};
// Loads the plan and send kernels into the current device's context now. Under lazy module
// loading (CUDA's default) a kernel's first launch may wait for the device to go idle, and a
// gated GEMM that is already spinning for the rows this send stores never lets it: the gated
// GEMM calls this before its launch. Cheap after the first call.
Status preload_send_rows_kernels();

// One warp per token on `blocks` blocks: the row is read once and stored at each of its
// destinations; then each destination's counter gets 1, with release semantics at system scope
// after a system fence, so a waiter that acquires the counter reads the whole row. An entry that
// fails a check is neither stored nor counted (its tile's waiter times out naming it) and is
// recorded in `error`.
Status send_rows_async(const SendRowsArgs& a, const RowPeers& peers, int blocks,
                       cudaStream_t stream);

// The world-1 form of the send, for a layer whose experts all live on this GPU: no peers, no
// gate counters, no fences. One warp per token on `blocks` blocks: token t's row of x is read
// once and stored at rows + gemm_row[t, k] * row_stride for each of its entries with
// 0 <= gemm_row < rows_capacity (a plan's rows; the plan's own error word records its failing
// entries, whose gemm_row is -1).
struct StoreRowsArgs {
  const void* x = nullptr;  // [tokens] rows of row_bytes, x_stride bytes apart, 16-byte aligned
  int64_t x_stride = 0;
  int64_t row_bytes = 0;  // a multiple of 16, at most row_stride
  int64_t tokens = 0, top_k = 0;
  const int64_t* gemm_row = nullptr;  // [tokens * top_k]
  void* rows = nullptr;               // [rows_capacity] rows, row_stride bytes apart
  int64_t row_stride = 0;             // a multiple of 16
  int64_t rows_capacity = 0;
};
Status store_token_rows_async(const StoreRowsArgs& a, int blocks, cudaStream_t stream);

// The reduce of this rank's tokens once their expert rows are in y ([y_rows][hidden] bf16):
// out[t] = sum_k topk_weights[t, k] * y[gemm_row[t, k]] over entries with gemm_row >= 0, in
// ascending k, fp32 with each product and sum rounded on its own, one rounding to bf16: the
// arithmetic of every combine (cuda/common/combine_reduce.cuh), so its bits are theirs. A row
// >= y_rows is skipped and recorded in `error` (kSendRowOutOfRange; zeroed by the caller); with
// `error` null it is skipped unrecorded (for rows a plan made, whose own error word covers them:
// no fill of a word nobody reads).
Status combine_rows_bf16(const void* y, int64_t y_rows, const int64_t* gemm_row,
                         const float* topk_weights, int64_t tokens, int64_t top_k, int64_t hidden,
                         void* out, unsigned long long* error, int blocks, cudaStream_t stream);

}  // namespace uniep::cuda
