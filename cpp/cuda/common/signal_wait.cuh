// Completion of a high-throughput transfer (dispatch rows, combine rows): counts, not per-row
// flags. Each block adds the rows it put to each destination to that destination's signal word
// for us; block 0 of every rank then waits until each source's word reaches the count both sides
// agreed on before the transfer. The kernel, and so the stream, completes only after that wait.
#pragma once

#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdint>

#include "cuda/common/device_wait.cuh"

namespace uniep::cuda {

// Called by every thread of every block once the block has issued its last put.
//   signals   this operation's [W] words, the same symmetric address on every rank: word s
//             counts the rows source s has delivered here
//   sent      [W] in shared memory: rows this block put to each destination
//   owed(s)   rows source s delivers here in this round (from the count exchange)
// Each wait that passes deadline_ns records (op, s) in err instead of hanging.
template <typename Owed>
__device__ __forceinline__ void signal_then_wait(uint64_t* signals, const unsigned long long* sent,
                                                 int64_t world, int64_t me, Owed owed,
                                                 uint64_t deadline_ns, DeviceError* err,
                                                 WaitOp op) {
  // Our stores are complete and visible system-wide before any peer can see the count; the
  // barrier also makes every warp's additions to `sent` visible to the threads that read it.
  nvshmem_quiet();
  __syncthreads();
  for (int64_t dst = threadIdx.x; dst < world; dst += blockDim.x) {
    if (sent[dst] > 0)
      nvshmemx_signal_op(&signals[me], sent[dst], NVSHMEM_SIGNAL_ADD, static_cast<int>(dst));
  }
  // One block waiting is enough: the counts are totals over the sender's blocks.
  if (blockIdx.x != 0) return;
  for (int64_t s = threadIdx.x; s < world; s += blockDim.x) {
    const uint64_t want = owed(s);
    if (want > 0) wait_at_least(&signals[s], want, deadline_ns, err, op, static_cast<int>(s));
  }
}

}  // namespace uniep::cuda
