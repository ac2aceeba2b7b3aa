// The MoE MegaKernel's forward (docs/megakernel.md): one persistent launch in which the first
// CTAs store the dispatch's rows into the GEMM rows of their experts' ranks (at world 1 in row
// order, so the first tiles are released first) and then join the GEMMs; both expert GEMMs run
// as one grouped GEMM whose tiles wait on tile gates (GEMM 1 on the rows, GEMM 2 on GEMM 1's done
// counters); and after its tiles each CTA's warps take the rank's tokens in turn, reducing each
// over k once its expert rows are written, reading them where they were computed. Several ranks
// run it through the runtime of fused_ep.hpp, which plans the rows and resolves the peers.
//
// The bits equal the sequential path's (send_rows, grouped_mm_gated twice, combine_rows): the
// same tile arithmetic, the same SwiGLU and rounding, the same fp32 reduce in ascending k. Which
// CTA sends a row or computes a tile, and when, never changes a bit.
//
// Plain device pointers; counters are zeroed by the caller. No host sync: the row counts stay on
// the device, buffers are sized by capacity (at world 1 tokens x top_k rows; with peers what the
// runtime of fused_ep.hpp sizes for the rows any rank may receive).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "uniep/cuda/tile_gate.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

// Several ranks (fused_ep.hpp): each rank's buffers as this rank reaches them (nvshmem_ptr
// mappings, its own for itself). The send stores a row at rows[d] of its destination d, the
// row's source (rank x slots_per_rank + t x top_k + k) at row_src[d], and counts it on
// counters[d]. GEMM 2's epilogue stores each output row straight into its source's combine slot
// (t x top_k + k of combine[source]) and signals done2 of its own rank; the reduce waits for
// done2[d] of each of its token's tiles and reads its own combine slots. So the outputs cross
// the links while GEMM 2 runs, and the reduce reads local memory. Capacity, counter count and
// slots are the same on every rank (symmetric buffers).
constexpr int kMaxFusedPeers = 8;
struct FusedPeers {
  int world_size = 1;  // 1: this rank only (the pointers below are not read)
  int rank = 0;
  int64_t slots_per_rank = 0;  // combine slots of each rank: max_tokens x top_k
  void* rows[kMaxFusedPeers] = {};
  int64_t* row_src[kMaxFusedPeers] = {};  // [capacity] each
  uint32_t* counters[kMaxFusedPeers] = {};
  void* combine[kMaxFusedPeers] = {};  // [slots_per_rank][hidden] bf16 each
  const uint32_t* done2[kMaxFusedPeers] = {};
  // combine[] again as a device array [world_size]: GEMM 2's epilogue indexes it per row, and a
  // copy of the table in its parameters would go to local memory.
  void* const* combine_table = nullptr;
};

struct FusedMoeArgs {
  const void* x = nullptr;  // [tokens][hidden] bf16
  int64_t tokens = 0, hidden = 0, top_k = 0;
  const float* topk_weights = nullptr;  // [tokens][top_k]
  // From the sender-side plan (plan_sender_rows_async): each entry's GEMM row and gate
  // counter, -1 for unused entries; row_entry is its inverse (fused_row_entries).
  const int64_t* gemm_row = nullptr;   // [tokens * top_k]
  const int64_t* counter = nullptr;    // [tokens * top_k]
  const int64_t* row_entry = nullptr;  // [capacity] entry t * top_k + k of each row, -1 none
                                       // (world 1 with fewer senders than CTAs only)
  const int64_t* dest_rank = nullptr;  // [tokens * top_k] each entry's rank (world > 1 only)
  // [tokens * top_k] the plan's send_order (world > 1 with fewer senders than CTAs only)
  const int64_t* send_order = nullptr;
  const void* w1_packed = nullptr;  // [E][hidden][2 * ffn] bf16, pack_gate_up's layout
  // Set: w1_packed holds w1 as the model stores it instead (gate columns [0, ffn), then up),
  // read without a packed copy (the grouped GEMM's kSwiGluPlain); ffn must then be a multiple
  // of 128. The same bits either way.
  bool w1_as_stored = false;
  const void* w2 = nullptr;  // [E][ffn][hidden] bf16
  int64_t num_experts = 0, ffn = 0;
  const int32_t* offs = nullptr;       // [E] cumulative row ends of the experts
  const int32_t* tile_base = nullptr;  // [E + 1] gate_tile_base(offs, capacity, tile_m)
  int64_t capacity = 0;                // rows of rows, act and y
  void* rows = nullptr;                // [capacity][hidden] bf16: GEMM 1's A
  void* act = nullptr;                 // [capacity][ffn] bf16: GEMM 2's A
  void* y = nullptr;    // [capacity][hidden] bf16: the experts' outputs (world 1; with peers they
                        // go to the combine slots and y may be null)
  void* out = nullptr;  // [tokens][hidden] bf16
  // Three counter arrays of num_counters each, zeroed: rows stored per tile, GEMM 1's and GEMM
  // 2's finished warps per tile.
  uint32_t* counters = nullptr;
  uint32_t* done1 = nullptr;
  uint32_t* done2 = nullptr;
  int64_t num_counters = 0;
  unsigned long long* error = nullptr;  // send_rows' error word, zeroed
  GateTimeout* timeout = nullptr;       // the first failed wait, zeroed
  uint64_t timeout_ns = 0;              // 0: wait forever (tests only)
  // World 1 only: the call zeroes counters, done1, done2, error and timeout itself (any
  // contents before), in the launch that readies its problem arrays: three fills fewer ahead
  // of the kernel. Across ranks peers store into the counters before this rank's call, so the
  // caller zeroes them (fused_ep.hpp does).
  bool zero_state = false;
  // The other ranks (world > 1): rows, counters and done2 above must be peers' own entries at
  // peers.rank. Their rows are this rank's GEMMs' (num_experts = its local experts).
  FusedPeers peers;
  // A call whose parity only the device knows (fused_ep.hpp, so that a CUDA graph of it can be
  // replayed): when set, done2 and peers.done2 are the parity-0 counters, and the call uses the
  // set (*parity_epoch & 1) x done2_parity_stride counters further.
  const uint64_t* parity_epoch = nullptr;
  int64_t done2_parity_stride = 0;
  // Optional (null: none), for tuning: per CTA c, trace[4c .. 4c + 3] = the global timer (ns)
  // at its start, after its send, after its GEMM tiles and after its reduce.
  unsigned long long* trace = nullptr;
  // Optional (null: none), for tuning: per CTA c, gate_wait_ns[2c] += the ns its producer spent
  // waiting at the rows' gates (GEMM 1) and gate_wait_ns[2c + 1] at GEMM 1's done gates (GEMM 2).
  // Zeroed by the caller.
  unsigned long long* gate_wait_ns = nullptr;
  // Optional (null: none), for tuning: per CTA c, tile_stamps[6c .. 6c + 5] = the global timer
  // when its producer reached its first tile's gate and when that gate let it load, the same for
  // its last tile, and when its consumers began and ended their last tile's epilogue.
  unsigned long long* tile_stamps = nullptr;
};

// The tuning point of the launch.
struct FusedMoeLaunch {
  int comm_ctas = 16;    // CTAs that send before they compute (rounded up to the cluster's 2);
                         // >= the grid: every CTA sends first
  int skip_rounds = -1;  // rounds of tiles the other CTAs take first; -1: from a bandwidth model
  int sm_count = 0;      // 0: every SM of the device
  // Output tile rows: 128 (cooperative 128 x 256 tiles, experts of many rows) or 64 (ping-pong
  // 64 x 256 tiles, experts of a few hundred rows). The plan's counters and tile_base must count
  // tiles of this height (sender_rows and gate_tile_base with this tile_m), and num_counters be
  // >= capacity / tile_m + E. It never changes the bits.
  int tile_m = 128;
  // Output tile columns: 256 (in clusters of two CTAs along M, which share each weight tile), or
  // with tile_m 64 also 128 in clusters of one: the decode shape, for experts of a few rows,
  // where the weight read is the whole cost and twice the tiles read at once (with
  // w1_as_stored, ffn must then be a multiple of 64 instead of 128). 0: 128 where tile_m is 64
  // and the capacity is at most 64 rows an expert, unless that puts GEMM 1's tiles in two rounds
  // of the SMs where 256 keeps one (fused_default_tile_n), else 256. It never changes the bits.
  int tile_n = 0;
};

// row_entry[r] = i for every entry i with gemm_row[i] = r < capacity (others -1): the order in
// which the fused kernel sends rows.
Status fused_row_entries(const int64_t* gemm_row, int64_t entries, int64_t capacity,
                         int64_t* row_entry, cudaStream_t stream);

size_t fused_moe_workspace_bytes(int64_t num_experts, int sm_count);

// The launch (see above); errors of the arguments come back as Status, errors found on the
// device (a bad row, a wait that timed out) in `error` and `timeout`.
Status moe_fused_forward_bf16(const FusedMoeArgs& a, const FusedMoeLaunch& launch, int device,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The routing's plan made by the launch itself (moe_fused_forward_planned_bf16): the values of
// plan_local_rows_async (uniep/cuda/send_rows.hpp) at the launch's tile_m, written by the
// kernel that readies the MegaKernel's problem arrays, so that a decode step is two launches,
// not three. All device pointers; nothing is written for zero tokens.
struct FusedLocalPlan {
  const int64_t* topk_idx = nullptr;  // [tokens][top_k] expert ids, -1 for no expert
  int64_t* gemm_row = nullptr;        // [tokens * top_k] written: each entry's GEMM row, or -1
  int64_t* counter = nullptr;         // [tokens * top_k] written: its tile counter, or -1
  int32_t* offs = nullptr;            // [E] written: the experts' cumulative row ends
  int32_t* tile_base = nullptr;       // [E + 1] written: each expert's first tile counter
  int64_t* counts = nullptr;          // [E] written: rows per expert (optional: null)
  // Where a bad expert id is reported (send_rows' error word, zeroed by the launch); null:
  // FusedMoeArgs::error, the kernel's own word.
  unsigned long long* error = nullptr;
};

// The planned launch's bounds: one block plans the entries (decode batches).
constexpr int64_t kFusedPlanMaxEntries = 4096;
constexpr int64_t kFusedPlanMaxExperts = 1024;

// Whether moe_fused_forward_planned_bf16 takes a call of `entries` = tokens x top_k entries over
// `num_experts` experts.
inline bool fused_plan_fits(int64_t entries, int64_t num_experts) {
  return entries >= 0 && entries <= kFusedPlanMaxEntries && num_experts >= 1 &&
         num_experts <= kFusedPlanMaxExperts;
}

// moe_fused_forward_bf16 at world 1 with the plan made in the launch: a's gemm_row, counter,
// offs and tile_base must be null (plan's are used), and so must row_entry and send_order; the
// call zeroes the counters, error and timeout itself (zero_state); every CTA sends
// (launch.comm_ctas >= the grid), token by token. A bad expert id is reported in plan.error
// (a.error where that is null). The same bits as plan_local_rows_async followed by
// moe_fused_forward_bf16.
Status moe_fused_forward_planned_bf16(FusedMoeArgs a, const FusedLocalPlan& plan,
                                      const FusedMoeLaunch& launch, int device, void* workspace,
                                      size_t workspace_bytes, cudaStream_t stream);

// The skip_rounds that skip_rounds = -1 picks for a send of `rows` rows by comm_ctas CTAs
// (exposed so tools can print it); with peers part of the rows cross NVLink.
int fused_default_skip_rounds(int64_t rows, int64_t hidden, int comm_ctas, int world_size = 1,
                              int tile_m = 128, int tile_n = 256);

// The tile_n that tile_n = 0 picks for `capacity` rows over `num_experts` experts of FFN size
// ffn with tiles of tile_m rows on sm_count SMs (uniep::fused_auto_tile_n, uniep/tuning.hpp):
// 128 where tile_m is 64 and the rows average at most one tile an expert, unless GEMM 1's tiles
// over the most experts a step can touch take two rounds of the SMs at 128 columns and one at
// 256; else 256. ffn or sm_count 0: without that check.
int fused_default_tile_n(int tile_m, int64_t capacity, int64_t num_experts, int64_t ffn = 0,
                         int sm_count = 0);

}  // namespace uniep::cuda
