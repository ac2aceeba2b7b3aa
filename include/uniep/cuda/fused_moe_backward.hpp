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
// Plain device pointers; the counters are zeroed by the caller. No host sync: buffers are sized
// by capacity (tokens x top_k rows), the row counts stay on the device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "uniep/cuda/tile_gate.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

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
};

size_t fused_moe_backward_workspace_bytes(int64_t num_experts, int sm_count);

// The launch on sm_count SMs (0: all of the device's). Errors of the arguments come back as
// Status; errors found on the device (a bad row, a wait that timed out) in `error` and `timeout`.
Status moe_fused_backward_rows_bf16(const FusedBackwardArgs& a, int sm_count, int device,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace uniep::cuda
