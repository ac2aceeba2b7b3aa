// Completion of a high-throughput transfer (dispatch rows, combine rows): counts, not per-row
// flags. Each block adds the rows it put to each destination to a local tally; the last block to
// finish sends each destination one signal with the total, then waits until each source's word
// reaches the count both sides agreed on before the transfer. The kernel, and so the stream,
// completes only after that wait.
//
// One remote atomic per (source, destination): when each of `sms` blocks added its own count to
// the same word of each peer, the target serialised those same-address atomics (the low-latency
// combine lost most of its time that way with E / W blocks).
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "cuda/common/device_wait.cuh"

namespace uniep::cuda {

// The block's per-destination row counts for signal_then_wait, zeroed (call from every thread).
__device__ __forceinline__ unsigned long long* block_send_counts(int64_t world) {
  __shared__ unsigned long long sent[kMaxTallyRanks];
  for (int64_t i = threadIdx.x; i < world; i += blockDim.x) sent[i] = 0;
  __syncthreads();
  return sent;
}

// Called by every thread of every block once the block has issued its last put.
//   signals   this operation's [W] words, the same symmetric address on every rank: word s
//             counts the rows source s has delivered here
//   sent      [W] in shared memory: rows this block put to each destination
//   tally     this operation's local totals (zero on entry; left zero)
//   owed(s)   rows source s delivers here in this round (from the count exchange)
// Each wait that passes deadline_ns records (op, s) in err instead of hanging.
template <typename Owed>
__device__ __forceinline__ void signal_then_wait(uint64_t* signals, const unsigned long long* sent,
                                                 CompletionTally* tally, int64_t world, int64_t me,
                                                 Owed owed, uint64_t deadline_ns, DeviceError* err,
                                                 WaitOp op) {
  __shared__ bool last;
  // Our stores are complete and visible system-wide before the count that covers them can be
  // seen; the barrier also makes every warp's additions to `sent` visible to the threads here.
  nvshmem_quiet();
  __syncthreads();
  for (int64_t dst = threadIdx.x; dst < world; dst += blockDim.x)
    if (sent[dst] > 0) atomicAdd(&tally->sent[dst], sent[dst]);
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&tally->finished, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;

  // Every other block's puts completed before its tally (quiet, then fence): signal the totals.
  __threadfence();
  for (int64_t dst = threadIdx.x; dst < world; dst += blockDim.x) {
    const unsigned long long total = atomicExch(&tally->sent[dst], 0ull);
    if (total > 0)
      nvshmemx_signal_op(&signals[me], total, NVSHMEM_SIGNAL_ADD, static_cast<int>(dst));
  }
  if (threadIdx.x == 0) tally->finished = 0;
  for (int64_t s = threadIdx.x; s < world; s += blockDim.x) {
    const uint64_t want = owed(s);
    if (want > 0) wait_at_least(&signals[s], want, deadline_ns, err, op, static_cast<int>(s));
  }
}

}  // namespace uniep::cuda
