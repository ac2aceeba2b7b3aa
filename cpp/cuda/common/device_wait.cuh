// Bounded device-side waits. A wait that passes its deadline records (operation, peer) in an
// error word the host can read, and returns false instead of spinning forever.
#pragma once

#include <cstdint>

namespace uniep::cuda {

enum class WaitOp : uint32_t {
  kNone = 0,
  kNotify = 1,
  kDispatch = 2,
  kCombine = 3,
  kCapacity = 4,  // not a wait: a low-latency region would overflow (peer = its rank)
  // Not waits: combine=rank_partials inputs the host cannot check without a sync.
  kCombineTarget = 5,   // row_target[have] = want is out of range or repeated
  kCombineMissing = 6,  // no row for (receive slot have, k = want) from source `peer`
  kCombineWeights = 7,  // topk_weights[have, want] differs from what the dispatch carried
  // Not a wait: this rank reused its plan (a cached dispatch) while rank `peer` sent new counts.
  kPlanMismatch = 8,
  // Not a wait: local expert `peer` got `have` rows in the received metadata, but its senders
  // announced `want` in the count exchange (a corrupt peer).
  kExpertRows = 9,
  // Not waits, a cached dispatch's barrier: rank `peer` failed its own argument checks; or its
  // round's signature (`have`) differs from rank 0's (`want`): another precision, combine or
  // row size.
  kPeerArgs = 10,
  kRoundMismatch = 11,
  // Not a wait: (token, k) entry `have` of this rank's topk_idx holds expert id `want` (an
  // int64's bits) outside [-1, num_experts); the low-latency dispatch sends it nowhere.
  kBadExpert = 12,
};

// Lives in host-mapped pinned memory: the host reads it after a stream sync without a copy.
struct DeviceError {
  uint32_t op;    // WaitOp of the first timeout, 0 if none
  int32_t peer;   // rank that did not answer
  uint64_t have;  // what the signal held when we gave up
  uint64_t want;  // what we waited for
};

// Per-launch totals of a high-throughput transfer (common/signal_wait.cuh): blocks add the rows
// they put to each destination here, and the last block to finish signals each peer once.
// Local memory; zero between launches (the last block clears it).
constexpr int kMaxTallyRanks = 256;
struct CompletionTally {
  unsigned int finished;                    // blocks done with their puts
  unsigned long long sent[kMaxTallyRanks];  // rows put to each destination
};

// Records the first error of a kernel (a timeout, an overflow, a bad input) for the host to
// raise; later ones are dropped, so one bad input does not flood the word.
__device__ __forceinline__ void report_error(DeviceError* err, WaitOp op, int peer, uint64_t have,
                                             uint64_t want) {
  if (atomicCAS(&err->op, 0u, static_cast<uint32_t>(op)) == 0u) {
    err->peer = peer;
    err->have = have;
    err->want = want;
    __threadfence_system();
  }
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Acquire at system scope: data a peer stored before its release (fence + signal) is visible
// after this load returns the signal.
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Waits until *signal >= want. Returns false (after recording the error) at the deadline.
__device__ __forceinline__ bool wait_at_least(const uint64_t* signal, uint64_t want,
                                              uint64_t deadline_ns, DeviceError* err, WaitOp op,
                                              int peer) {
  uint64_t have = load_acquire_sys(signal);
  while (have < want) {
    if (global_timer_ns() > deadline_ns) {
      report_error(err, op, peer, have, want);
      return false;
    }
    have = load_acquire_sys(signal);
  }
  return true;
}

}  // namespace uniep::cuda
