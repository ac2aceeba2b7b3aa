// Notify: every rank puts its routing counts ([W] tokens per rank, [E] rows per expert) into every
// peer's count matrix, waits for all rows, and derives the offsets all ranks agree on. The slot
// plan of uniep/plan.hpp follows from these prefix sums alone.
//
// Block 0 does that; blocks 1..W meanwhile number our tokens per destination (the send index):
// a token's slot on rank d is the base of our slots there (from the counts) plus its index.
#include <nvshmem.h>
#include <nvshmemx.h>
#include <cub/block/block_scan.cuh>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 256;

// The previous round's completion words restart. No peer can add to them before it has seen our
// count signal of the new round, which exchange_count_row releases after these stores.
__device__ __forceinline__ void restart_completion_words(const SymmetricView& sym, int64_t W) {
  for (int64_t i = threadIdx.x; i < W; i += blockDim.x) {
    sym.signals[kDispatchSignal * W + i] = 0;
    sym.signals[kCombineSignal * W + i] = 0;
  }
}

// Puts words [first, first + n) of our staged count row into row `me` of every peer's count
// matrix, with this round's signal, and waits for every peer's. Two matrices by epoch parity: a
// rank can run at most one round ahead of a peer (it needs the peer's signal of the same epoch),
// so it never overwrites a row still being read. Returns this round's matrix, or nullptr when a
// wait timed out (recorded in err). Called by every thread of the block, after the staging.
__device__ int64_t* exchange_count_row(const SymmetricView& sym, const EpDims& d, uint64_t epoch,
                                       int64_t first, int64_t n, uint64_t deadline,
                                       DeviceError* err) {
  const int64_t W = d.world_size, C = W + d.num_experts + 1, me = d.rank;
  int64_t* const counts = sym.counts + static_cast<int64_t>(epoch & 1) * W * C;
  for (int64_t pe = threadIdx.x; pe < W; pe += blockDim.x)
    nvshmem_putmem_signal_nbi(counts + me * C + first, sym.count_stage + first, n * sizeof(int64_t),
                              &sym.signals[kCountSignal * W + me], epoch, NVSHMEM_SIGNAL_SET,
                              static_cast<int>(pe));
  nvshmem_quiet();
  __shared__ int waits_failed;
  if (threadIdx.x == 0) waits_failed = 0;
  __syncthreads();
  for (int64_t s = threadIdx.x; s < W; s += blockDim.x)
    if (!wait_at_least(&sym.signals[kCountSignal * W + s], epoch, deadline, err, WaitOp::kNotify,
                       static_cast<int>(s)))
      atomicAdd(&waits_failed, 1);
  __threadfence();
  __syncthreads();
  return waits_failed ? nullptr : counts;
}

// The offsets every rank agrees on, from the exchanged count matrix, by the whole block: a
// thread per local expert and a warp per rank, since one thread walking the W x E matrix (and
// writing the host-mapped words one by one) was most of this kernel's time.
// Host-mapped: host_counts = [num_recv, recv_from[W], rows_per_expert[El], rows_back[W], epoch].
__device__ void derive_plan(const int64_t* counts, const EpDims& d, const PlanCounts& plan,
                            int64_t* host_counts, int64_t* tokens_per_local_expert,
                            uint64_t epoch) {
  const int64_t W = d.world_size, E = d.num_experts, C = W + E + 1, me = d.rank;
  const int64_t El = d.experts_per_rank, first = me * El;
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  // Rows per local expert, summed over the sources in rank order, as each thread's run of
  // experts; then an exclusive scan of the runs across the block.
  const int64_t per_thread = (El + kThreads - 1) / kThreads;
  const int64_t lo = threadIdx.x * per_thread, hi = lo + per_thread < El ? lo + per_thread : El;
  int64_t run = 0;
  for (int64_t e = lo; e < hi; ++e) {
    int64_t rows = 0;
    for (int64_t s = 0; s < W; ++s) rows += counts[s * C + W + first + e];
    host_counts[1 + W + e] = rows;
    tokens_per_local_expert[e] = rows;
    run += rows;
  }
  __shared__ int64_t scan[kThreads];
  scan[threadIdx.x] = run;
  __syncthreads();
  for (int step = 1; step < kThreads; step *= 2) {
    const int64_t add = threadIdx.x >= step ? scan[threadIdx.x - step] : 0;
    __syncthreads();
    scan[threadIdx.x] += add;
    __syncthreads();
  }
  int64_t offset = scan[threadIdx.x] - run;
  for (int64_t e = lo; e < hi; ++e) {  // device memory: reading the host-mapped copy crosses PCIe
    plan.expert_offsets[e] = offset;
    offset += tokens_per_local_expert[e];
  }
  if (threadIdx.x == kThreads - 1) plan.expert_offsets[El] = scan[kThreads - 1];

  // Rows each rank returns to us: the rows we routed to its experts, a warp per rank.
  for (int64_t dst = warp; dst < W; dst += kWarps) {
    int64_t back = 0;
    for (int64_t e = dst * El + lane; e < (dst + 1) * El; e += 32) back += counts[me * C + W + e];
    for (int o = 16; o > 0; o /= 2) back += __shfl_xor_sync(0xffffffffu, back, o);
    if (lane == 0) {
      plan.rows_back[dst] = back;
      host_counts[1 + W + El + dst] = back;
    }
  }

  // W is at most a few dozen: the per-rank offsets stay with one thread.
  if (threadIdx.x == 0) {
    plan.recv_offsets[0] = 0;
    for (int64_t s = 0; s < W; ++s) {
      plan.recv_offsets[s + 1] = plan.recv_offsets[s] + counts[s * C + me];
      host_counts[1 + s] = counts[s * C + me];
    }
    host_counts[0] = plan.recv_offsets[W];
    for (int64_t dst = 0; dst < W; ++dst) {
      int64_t base = 0;
      for (int64_t s = 0; s < me; ++s) base += counts[s * C + dst];
      plan.send_base[dst] = base;
    }
  }
  // The host spins on the last word (the round's epoch): every count must be visible first.
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0)
    *reinterpret_cast<volatile int64_t*>(host_counts + 1 + W + El + W) =
        static_cast<int64_t>(epoch);
}

// Our tokens' indices among those we send to rank dst, in token order: an exclusive scan of
// token_in_rank, kItems consecutive tokens per thread.
__device__ void number_tokens(const bool* token_in_rank, int64_t tokens, int64_t W, int64_t dst,
                              int64_t* send_index) {
  constexpr int kItems = 16;
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  int64_t running = 0;
  for (int64_t t0 = 0; t0 < tokens; t0 += kThreads * kItems) {
    const int64_t first = t0 + threadIdx.x * kItems;
    bool sends[kItems];
    int count = 0;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      sends[i] = first + i < tokens && token_in_rank[(first + i) * W + dst];
      count += sends[i] ? 1 : 0;
    }
    int prefix, total;
    Scan(temp).ExclusiveSum(count, prefix, total);
    int64_t index = running + prefix;
#pragma unroll
    for (int i = 0; i < kItems; ++i)
      if (first + i < tokens) send_index[(first + i) * W + dst] = sends[i] ? index++ : -1;
    running += total;
    __syncthreads();  // temp is reused by the next chunk
  }
}

__global__ void __launch_bounds__(kThreads)
    notify_kernel(SymmetricView sym, EpDims d, const int64_t* tokens_per_rank,
                  const int64_t* tokens_per_expert, const unsigned long long* layout_error,
                  const bool* token_in_rank, int64_t tokens, uint64_t epoch, uint64_t timeout_ns,
                  PlanCounts plan, int64_t* host_counts, int64_t* tokens_per_local_expert,
                  int64_t* send_index, int32_t* round_ok, DeviceError* err, int64_t signature,
                  bool args_invalid) {
  const int64_t W = d.world_size, E = d.num_experts, C = W + E + 1;
  if (blockIdx.x > 0) {
    number_tokens(token_in_rank, tokens, W, blockIdx.x - 1, send_index);
    return;
  }
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  restart_completion_words(sym, W);
  if (threadIdx.x == 0) *round_ok = 0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    int64_t v;
    if (args_invalid)
      v = i < C - 1 ? 0 : round_word(kRoundArgsInvalid, signature);
    else if (i < W)
      v = tokens_per_rank[i];
    else if (i < W + E)
      v = tokens_per_expert[i - W];
    else
      v = round_word(*layout_error == ~0ull ? kRoutingValid : kRoutingInvalid, signature);
    sym.count_stage[i] = v;
  }
  __threadfence_system();
  __syncthreads();
  const int64_t* const counts = exchange_count_row(sym, d, epoch, 0, C, deadline, err);
  if (counts == nullptr) return;

  // The first rank without valid counts fails the round on every rank (launch_notify says how
  // host_counts[0] names it); then the first whose signature differs from rank 0's.
  __shared__ int64_t invalid_rank;
  if (threadIdx.x == 0) {
    invalid_rank = -1;
    int64_t offset = 0;
    for (int64_t s = W - 1; s >= 0; --s) {
      const int64_t kind = word_kind(counts[s * C + C - 1]);
      if (kind != kRoutingValid) {
        invalid_rank = s;
        offset = kind == kRoutingReused ? W : kind == kRoundArgsInvalid ? 2 * W : 0;
      }
    }
    const int64_t first = counts[C - 1];
    for (int64_t s = 1; s < W && invalid_rank < 0; ++s) {
      const int64_t word = counts[s * C + C - 1];
      if (word_signature(word) != word_signature(first)) {
        invalid_rank = s;
        offset = 3 * W;
        host_counts[1] = first;
        host_counts[2] = word;
      }
    }
    if (invalid_rank >= 0) {
      host_counts[0] = -1 - invalid_rank - offset;
      __threadfence_system();
    }
  }
  __syncthreads();
  if (invalid_rank >= 0) return;

  derive_plan(counts, d, plan, host_counts, tokens_per_local_expert, epoch);
  if (threadIdx.x == 0) *round_ok = 1;  // read by the kernels after this one on the stream
}

// The barrier of a round that reuses the last plan. Only the validity word of our count row
// travels (as kRoutingReused), with the round's signal; the peers' words say whether they reused
// theirs too. The counts, the plan and the send indices stay as the last notify left them.
__global__ void __launch_bounds__(kThreads)
    reuse_plan_kernel(SymmetricView sym, EpDims d, uint64_t epoch, uint64_t timeout_ns,
                      int32_t* round_ok, DeviceError* err, int64_t signature, bool args_invalid) {
  const int64_t W = d.world_size, C = W + d.num_experts + 1;
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  restart_completion_words(sym, W);
  if (threadIdx.x == 0) {
    sym.count_stage[C - 1] =
        round_word(args_invalid ? kRoundArgsInvalid : kRoutingReused, signature);
    *round_ok = 0;
  }
  __threadfence_system();
  __syncthreads();
  const int64_t* const counts = exchange_count_row(sym, d, epoch, C - 1, 1, deadline, err);
  if (counts == nullptr) return;
  if (threadIdx.x != 0 || args_invalid) return;  // that rank raises its own error already
  for (int64_t s = 0; s < W; ++s) {
    const int64_t word = counts[s * C + C - 1];
    if (word_kind(word) != kRoutingReused) {
      report_error(err,
                   word_kind(word) == kRoundArgsInvalid ? WaitOp::kPeerArgs : WaitOp::kPlanMismatch,
                   static_cast<int>(s), static_cast<uint64_t>(word), kRoutingReused);
      return;
    }
  }
  for (int64_t s = 1; s < W; ++s) {
    if (word_signature(counts[s * C + C - 1]) != word_signature(counts[C - 1])) {
      report_error(err, WaitOp::kRoundMismatch, static_cast<int>(s),
                   static_cast<uint64_t>(counts[s * C + C - 1]),
                   static_cast<uint64_t>(counts[C - 1]));
      return;
    }
  }
  *round_ok = 1;
}

}  // namespace

void launch_reuse_plan(const SymmetricView& sym, const EpDims& d, uint64_t epoch,
                       uint64_t timeout_ns, int32_t* round_ok, DeviceError* err, int64_t signature,
                       bool args_invalid, cudaStream_t stream) {
  reuse_plan_kernel<<<1, kThreads, 0, stream>>>(sym, d, epoch, timeout_ns, round_ok, err, signature,
                                                args_invalid);
}

void launch_notify(const SymmetricView& sym, const EpDims& d, const int64_t* tokens_per_rank,
                   const int64_t* tokens_per_expert, const unsigned long long* layout_error,
                   const bool* token_in_rank, int64_t tokens, uint64_t epoch, uint64_t timeout_ns,
                   PlanCounts plan, int64_t* host_counts, int64_t* tokens_per_local_expert,
                   int64_t* send_index, int32_t* round_ok, DeviceError* err, int64_t signature,
                   bool args_invalid, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(1 + (tokens > 0 && !args_invalid ? d.world_size : 0));
  notify_kernel<<<blocks, kThreads, 0, stream>>>(
      sym, d, tokens_per_rank, tokens_per_expert, layout_error, token_in_rank, tokens, epoch,
      timeout_ns, plan, host_counts, tokens_per_local_expert, send_index, round_ok, err, signature,
      args_invalid);
}

}  // namespace uniep::cuda
