// The first launch of the MegaKernel's backward at world 1 (docs/megakernel.md, "The fused
// backward"): one persistent kernel in which every CTA first stores the rows of x and of
// grad_out into the GEMM rows of their experts (one count per row on its tile gate, once both
// are in), then all CTAs run one gated grouped GEMM over 2E groups:
//   groups [0, E):   h        = rows_x  w1[e]    ([capacity][2 ffn], w1 [E][hidden][2 ffn])
//   groups [E, 2E):  grad_act = rows_go w2t[e]   ([capacity][ffn],   w2t [E][hidden][ffn])
// each tile waiting on its rows' gate. Both halves read their weight N-major (w2t is w2
// transposed, kept by the caller per weight version): one CUTLASS body takes one B layout, and the
// rows are those grad_act = grad_out w2^T needs. The element-wise pass, grad_rows = grad_h w1^T,
// the reduce over k and the weight gradients follow as their own launches.
//
// The bits are those of the sequential path (send_rows twice, grouped_mm_gated twice): the same
// GEMM body, and a row's GEMM never depends on which CTA stored it or when.
//
// Several ranks (include/uniep/cuda/fused_ep.hpp, Runtime::backward_rows): with `peers`, each
// entry's rows go to the GEMM rows of its expert's rank (dest_rank, the forward's plan), with the
// row's source slot and routing weight beside them, counted on that rank's tile gate at system
// scope; the GEMMs run on this rank's rows, which the peers' launches store. The rows' gradients
// then go back to their sources with moe_fused_backward_return_bf16 (below).
//
// Plain device pointers; the counters are zeroed by the caller. No host sync: buffers are sized
// by capacity (tokens x top_k rows at world 1), the row counts stay on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/tile_gate.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

// Each rank's backward buffers as this rank reaches them (nvshmem_ptr mappings, its own for
// itself); the same capacity, counters and slots on every rank (symmetric buffers). Null
// row_src[0]: no peer table (the world-1 launch, whose rows need no sources).
struct FusedBackwardPeers {
  int world_size = 1;
  int rank = 0;
  int64_t slots_per_rank = 0;  // max_tokens x top_k: a row's source is rank x this + t x K + k
  void* rows_x[kMaxFusedPeers] = {};       // [capacity][hidden] bf16
  void* rows_go[kMaxFusedPeers] = {};      // [capacity][hidden] bf16
  int64_t* row_src[kMaxFusedPeers] = {};   // [capacity]
  float* row_w[kMaxFusedPeers] = {};       // [capacity] each row's routing weight
  uint32_t* counters[kMaxFusedPeers] = {};  // the tile gates' counters
};

struct FusedBackwardArgs {
  const void* x = nullptr;         // [tokens][hidden] bf16
  const void* grad_out = nullptr;  // [tokens][hidden] bf16
  int64_t tokens = 0, hidden = 0, top_k = 0;
  // The forward's plan (sender_rows at world 1 with the gate's 128-row tiles): each entry's
  // GEMM row and tile counter, -1 for unused entries.
  const int64_t* gemm_row = nullptr;  // [tokens * top_k]
  const int64_t* counter = nullptr;   // [tokens * top_k]
  const void* w1 = nullptr;           // [E][hidden][2 * ffn] bf16 (gate columns, then up)
  const void* w2t = nullptr;          // [E][hidden][ffn] bf16: w2 [E][ffn][hidden] transposed
  int64_t num_experts = 0, ffn = 0;
  const int32_t* offs = nullptr;       // [E] cumulative row ends of the experts
  const int32_t* tile_base = nullptr;  // [E + 1] gate_tile_base(offs, capacity, 128)
  int64_t capacity = 0;                // rows of every buffer below, >= tokens x top_k
  void* rows_x = nullptr;              // [capacity][hidden] bf16
  void* rows_go = nullptr;             // [capacity][hidden] bf16
  void* h = nullptr;                   // [capacity][2 * ffn] bf16
  void* grad_act = nullptr;            // [capacity][ffn] bf16
  uint32_t* counters = nullptr;        // [num_counters], zeroed: rows stored per tile
  int64_t num_counters = 0;            // >= capacity / 128 + E
  unsigned long long* error = nullptr;  // send_rows' error word, zeroed
  GateTimeout* timeout = nullptr;       // the first failed wait, zeroed
  uint64_t timeout_ns = 0;              // 0: wait forever (tests only)
  // Optional (null: none), for tuning: per CTA c, trace[4c .. 4c + 3] = the global timer (ns) at
  // its start, after its send and after its GEMM tiles, twice (the forward's reduce stamp; this
  // launch has no reduce).
  unsigned long long* trace = nullptr;
  // With a peer table (any world size): rows_x, rows_go and counters above must be its entries
  // at peers.rank, and the plan's dest_rank and the routing weights are read too. A rank with no
  // tokens still runs (its experts compute the peers' rows).
  FusedBackwardPeers peers;
  const int64_t* dest_rank = nullptr;   // [tokens * top_k] (with a peer table only)
  const float* topk_weights = nullptr;  // [tokens * top_k] (with a peer table only)
};

size_t fused_moe_backward_workspace_bytes(int64_t num_experts, int sm_count);

// The launch on sm_count SMs (0: all of the device's). Errors of the arguments come back as
// Status; errors found on the device (a bad row, a wait that timed out) in `error` and `timeout`.
Status moe_fused_backward_rows_bf16(const FusedBackwardArgs& a, int sm_count, int device,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The rows' gradients back to their sources across ranks, and each source's reduce: every row r
// < rows_end of this rank stores grad_rows[r] into slot (t, k) of its source rank's grad slots
// and dots[r] beside it (row_src[r] = rank x slots_per_rank + t x top_k + k), then publishes
// the slot's flag = this call's epoch at system scope; then (a second launch, so no CTA waits
// before every push of this rank is out) each of this rank's tokens waits for the flags of its
// used entries (gemm_row >= 0), bounded, and sums its slots over k in ascending order in fp32
// with unit weights (the combines' arithmetic: combine_reduce.cuh) into grad_x, and copies the
// dots into grad_w (0 for unused entries). The bits are those of a combine with unit weights of
// the same rows.
struct FusedReturnArgs {
  // This rank's expert rows.
  const void* grad_rows = nullptr;  // [capacity][hidden] bf16
  const float* dots = nullptr;      // [capacity]
  const int64_t* row_src = nullptr;  // [capacity] (this rank's, as the send wrote it)
  const int32_t* rows_end = nullptr;  // device word: the rows in use (offs[E - 1])
  int64_t capacity = 0, hidden = 0;
  // This rank's tokens.
  const int64_t* gemm_row = nullptr;  // [tokens * top_k] the plan: -1 for unused entries
  int64_t tokens = 0, top_k = 0;
  void* grad_x = nullptr;  // [tokens][hidden] bf16
  float* grad_w = nullptr;  // [tokens * top_k]
  // Every rank's slots (nvshmem_ptr mappings; slots_per_rank each).
  int world_size = 1, rank = 0;
  int64_t slots_per_rank = 0;
  void* slots[kMaxFusedPeers] = {};          // [slots_per_rank][hidden] bf16
  float* slot_dots[kMaxFusedPeers] = {};     // [slots_per_rank]
  uint32_t* slot_flag[kMaxFusedPeers] = {};  // [slots_per_rank], never zeroed: epochs only grow
  const uint64_t* epoch_word = nullptr;      // this call's epoch (the runtime's device word)
  unsigned long long* error = nullptr;       // send_rows' error word (a bad row source)
  GateTimeout* timeout = nullptr;            // flag 3: a token's slot never came
  uint64_t timeout_ns = 0;
};

Status moe_fused_backward_return_bf16(const FusedReturnArgs& a, int sm_count,
                                      cudaStream_t stream);

}  // namespace uniep::cuda
