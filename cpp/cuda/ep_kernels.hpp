// Launchers of the expert-parallel kernels (dispatch/, combine/), called by the runtime in
// cpp/runtime. Plain structs of device pointers; nothing here owns memory.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/common/device_wait.cuh"
#include "cuda/dispatch/expert_rows.hpp"

namespace uniep::cuda {

// Views of one runtime's NVSHMEM symmetric allocation (same offsets on every rank).
struct SymmetricView {
  uint64_t* signals;       // [kSignalKinds][W]
  CompletionTally* tally;  // [kSignalKinds], used locally only (zero at creation)
  int64_t* counts;         // [2][W][W + E + 1]: by epoch parity, row s written by rank s
  int64_t* count_stage;    // [W + E + 1]: this rank's row (+ routing-valid word) before the put
  uint8_t* recv_x;         // [W * max_tokens][row_cap]
  int64_t* recv_meta;      // [W * max_tokens][1 + K]: source token, K global expert ids
  float* recv_weights;     // [W * max_tokens][K]
  uint8_t* combine;        // [max_tokens * max(K, W)][H * 2]: (token, k) rows, or with rank
                           // partials (token, rank) rows at token * W + rank
};
enum SignalKind : int {
  kCountSignal = 0,
  kDispatchSignal = 1,
  kCombineSignal = 2,
  kSignalKinds = 3
};

// Low-latency mode (decode batches): fixed regions per (local expert, source rank), so no count
// exchange and no host sync. Two buffer sets, so two rounds can be in flight. ll_tokens == 0:
// not allocated.
struct LowLatencyView {
  int64_t ll_tokens;    // capacity: tokens per source rank
  uint8_t* x[2];        // [E_local][W][ll_tokens][row_cap]
  int64_t* meta[2];     // [E_local][W][ll_tokens]: src_token * K + k
  uint64_t* count[2];   // [E_local][W] signal: rows + 1, set by the source
  uint8_t* combine[2];  // [ll_tokens * K][H * 2] at the source
  uint64_t* back[2];    // [E_local][W] signal: rows + 1, set by rank w for its expert e
  int32_t* recv_count;  // [2][E_local][W] local (not symmetric): rows per region, for the ops
};

struct EpDims {
  int64_t world_size, rank, num_experts, experts_per_rank, top_k, hidden, max_tokens, row_cap;
};

// Counts every rank agreed on, derived on the device right after the exchange.
struct PlanCounts {
  int64_t* recv_offsets;    // [W + 1] slots per source rank
  int64_t* send_base;       // [W] first slot of ours on each destination
  int64_t* expert_offsets;  // [E_local + 1] grouped-GEMM rows per local expert
  int64_t* rows_back;       // [W] expert rows each rank returns to us
  int64_t* sent_to;         // [W] tokens we send to each rank (= rank partials it returns)
};

// layout_error: the routing-layout kernel's error word (~0 when every expert id was valid). It
// travels with the counts, so a rank with bad routing makes every rank fail together instead of
// leaving its peers to time out. signature: this round's (round_signature); args_invalid: this
// rank's arguments failed its own checks, so it joins the exchange only to fail the round (no
// layout was computed: tokens_per_* and layout_error are not read). A failed round leaves
// host_counts[0] = -1 - s - kind_offset for the first failing rank s, kind_offset 0 for bad
// routing, W for a plan reuse, 2W for failed argument checks, 3W for a signature that differs
// from rank 0's (then host_counts[1] = rank 0's word, host_counts[2] = rank s's).
// host_counts = [num_recv, recv_from[W], rows_per_expert[El], rows_back[W], epoch]: the last word
// is written last, after the others are visible, and only when the round is valid.
// *round_ok: 1 once the plan of a valid round is derived, else 0 (a failed wait, bad routing): the
// transfer, enqueued before the host has read the counts, then does nothing.
// send_index [tokens][W]: our token t's place among the tokens we send to rank d, in token order
// (-1 where it skips d), from token_in_rank; the local half of each send slot, derived by blocks
// of their own beside the exchange (it needs no peer), so no kernel between notify and transfer.
void launch_notify(const SymmetricView& sym, const EpDims& d, const int64_t* tokens_per_rank,
                   const int64_t* tokens_per_expert, const unsigned long long* layout_error,
                   const bool* token_in_rank, int64_t tokens, uint64_t epoch, uint64_t timeout_ns,
                   PlanCounts plan, int64_t* host_counts, int64_t* tokens_per_local_expert,
                   int64_t* send_index, int32_t* round_ok, DeviceError* err, int64_t signature,
                   bool args_invalid, cudaStream_t stream);

// Validity word of a count row (the last of its W + E + 1): in its low byte, what the round
// behind it was; above it, the round's signature (round_signature), which every rank must share:
// a rank that sent fp8 rows into a peer expecting bf16 ones would corrupt it silently.
constexpr int64_t kRoutingInvalid = 0;
constexpr int64_t kRoutingValid = 1;
constexpr int64_t kRoutingReused = 2;     // no counts: the sender reuses its last plan
constexpr int64_t kRoundArgsInvalid = 3;  // the sender's arguments failed its own checks
constexpr int64_t kRoutingWordBits = 8;

// What every rank's round must share: the bytes of a row, fp8 or not, and the combine it is
// made for. Plain fields (not a hash), so a mismatch can be named.
__host__ __device__ constexpr int64_t round_signature(int64_t row_bytes, bool fp8,
                                                      bool rank_partials) {
  return (row_bytes << 2) | (fp8 ? 1 : 0) | (rank_partials ? 2 : 0);
}
__host__ __device__ constexpr int64_t round_word(int64_t kind, int64_t signature) {
  return kind | (signature << kRoutingWordBits);
}
__host__ __device__ constexpr int64_t word_kind(int64_t word) {
  return word & ((int64_t{1} << kRoutingWordBits) - 1);
}
__host__ __device__ constexpr int64_t word_signature(int64_t word) {
  return word >> kRoutingWordBits;
}

// A round on the plan of the last notify (a cached dispatch: same routing, other rows): resets
// the round's completion words and passes a barrier with every peer, which tells each peer that
// this rank reuses its plan. *round_ok becomes 1, or 0 when a peer sent new counts instead
// (kPlanMismatch), failed its argument checks (kPeerArgs) or a signature other than rank 0's
// (kRoundMismatch); the dispatch that follows then moves nothing. args_invalid: this rank only
// passes the barrier to fail the round (and reports nothing of its own).
void launch_reuse_plan(const SymmetricView& sym, const EpDims& d, uint64_t epoch,
                       uint64_t timeout_ns, int32_t* round_ok, DeviceError* err, int64_t signature,
                       bool args_invalid, cudaStream_t stream);

struct DispatchArgs {
  const uint8_t* x;
  int64_t row_bytes;   // of x; for fp8 the bf16 row (hidden * 2)
  int64_t fp8_hidden;  // 0: rows travel verbatim; >0: bf16 rows of this many columns are
                       // cast to e4m3 with one fp32 scale per 1x128 block on the way
                       // (H e4m3 bytes then H / 128 scales: at most 2H, the row capacity)
  const int64_t* topk_idx;
  const float* topk_weights;
  int64_t tokens;
  const int64_t* send_index;  // [tokens][W] from notify: the token's receive slot on rank d is
                              // plan.send_base[d] + send_index[t][d]; -1 where it skips d
  PlanCounts plan;
  uint64_t timeout_ns;  // each wait gives up this long after the kernel starts
  DeviceError* err;
  // A cached dispatch: the rows only. The slots' metadata and weights are the plan's, already
  // there; topk_idx and topk_weights are unused, and of the outputs only recv_x/recv_scales.
  bool rows_only;
  const int32_t* round_ok;  // the verdict of the round's notify or reuse barrier: 0 moves nothing
};

// Where the received rows go. recv_x == nullptr: they stay in the receive buffer (sym.recv_x).
struct DispatchOutputs {
  uint8_t* recv_x;     // [N, row_bytes], or [N, H] e4m3 for fp8
  float* recv_scales;  // fp8 with recv_x: [N, H / 128]
  int64_t* recv_src;   // the rest: not with rows_only
  int64_t* recv_topk_idx;
  float* recv_topk_weights;
};

// The transfer, on `blocks` SMs (the communication budget): every row to its slot on each peer,
// the metadata of every slot (ours too), then the wait for every peer's rows. Our own rows are
// left to launch_self_rows.
void launch_transfer(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a, int blocks,
                     cudaStream_t stream);
// Our own rows, from x (cast for fp8) to out.recv_x or to our own receive slots: needs only the
// send slots, so it runs on the SMs the transfer leaves free.
void launch_self_rows(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a,
                      const DispatchOutputs& out, int blocks, cudaStream_t stream);
// After the transfer: the peers' rows (when out.recv_x) and every slot's metadata copied out of
// the receive buffer, by `blocks` blocks.
void launch_copy_out(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a,
                     const DispatchOutputs& out, int blocks, cudaStream_t stream);

struct CombineArgs {
  const uint8_t* y;  // [rows][H] bf16, or fp32 where y_f32 (combine=rank_partials only)
  const int64_t* row_target;
  int64_t rows;
  const int64_t* topk_idx;
  const float* topk_weights;
  int64_t tokens;
  PlanCounts plan;
  uint8_t* out;         // [tokens][H] bf16
  uint64_t timeout_ns;  // each wait gives up this long after the kernel starts
  DeviceError* err;
  bool y_f32 = false;
};
// combine=per_k's rows that stay on this rank: instead of a copy into our own slot, the slot's
// entry names the row of y (epoch << 32 | row; an entry of another round reads as "copied").
// row_of_slot == nullptr: every row is copied.
struct SelfRowIndex {
  uint64_t* row_of_slot;  // [max_tokens * K], this rank's slots
  uint32_t epoch;
};
// `blocks` carry the rows; `reduce_blocks` do the reduction.
void launch_combine(const SymmetricView& sym, const EpDims& d, const CombineArgs& a,
                    const SelfRowIndex& self, int blocks, int reduce_blocks, cudaStream_t stream);

// combine=rank_partials. Besides CombineArgs, what the runtime keeps from the dispatch:
struct RankPartialsArgs {
  uint64_t* row_of_target;          // [W * max_tokens * K] workspace: epoch << 32 | row
  uint32_t epoch;                   // tags this round's entries of row_of_target
  const float* dispatched_weights;  // [tokens, K]: the weights the dispatch carried
  const bool* token_in_rank;        // [tokens][W]: the token went to that rank
};
// `num_sms` SMs' worth of blocks (the combine's budget, the tuning's total: the whole GPU by
// default, since the expert rows are read once, K / W times the bytes sent) sum each receive
// slot's rows and store the partial into the source's combine buffer, over NVLink for peers;
// then sum each of our tokens' partials. Any grid gives the same bits.
void launch_combine_rank_partials(const SymmetricView& sym, const EpDims& d, const CombineArgs& a,
                                  const RankPartialsArgs& p, int num_sms, cudaStream_t stream);

// Each block takes one global expert: finds this rank's (token, k) pairs routed to it in
// (token, k) order and puts the rows at consecutive positions of region (expert, us) on the
// expert's rank; blocks of our own experts then wait for every source's count.
void launch_ll_dispatch(const LowLatencyView& ll, const EpDims& d, int buffer, const uint8_t* x,
                        const int64_t* topk_idx, int64_t tokens, uint64_t timeout_ns,
                        DeviceError* err, cudaStream_t stream);

// y: [E_local][W * ll_tokens][H] bf16 in the dispatch's layout. Rows go back to (token, k) slots
// of their source; then out[t] = sum_k w[t,k] * y_(t,k), k ascending, fp32 (as the HT combine).
void launch_ll_combine(const LowLatencyView& ll, const EpDims& d, int buffer, const uint8_t* y,
                       const int64_t* topk_idx, const float* topk_weights, int64_t tokens,
                       uint8_t* out, int reduce_blocks, uint64_t timeout_ns, DeviceError* err,
                       cudaStream_t stream);

}  // namespace uniep::cuda
