// The error word of the MegaKernel's dispatch (uniep/cuda/send_rows.hpp, and its CPU reference
// plan_sender_rows in uniep/plan.hpp) and its message. No CUDA headers: the core and the Python
// module use it on machines without CUDA, and the C++ package installs it without the CUDA ones.
#pragma once

#include <cstdint>

#include "uniep/status.hpp"

namespace uniep {

// What went wrong with a failing (token, k) entry (the first one recorded; with several, which
// one wins is a race), in the error word:
// (code << kSendErrorShift) | entry, entry = token * K + k. 0: nothing.
constexpr uint64_t kSendBadExpert = 1;          // topk_idx holds an id outside [-1, num_experts)
constexpr uint64_t kSendOverCount = 2;          // more rows to an expert than the rank's count
constexpr uint64_t kSendBadPeer = 3;            // dest_rank has no entry in the peer table
constexpr uint64_t kSendRowOutOfRange = 4;      // gemm_row lies outside the destination's rows
constexpr uint64_t kSendCounterOutOfRange = 5;  // the gate counter lies outside its counters
constexpr int kSendErrorShift = 48;

constexpr uint64_t send_error_word(uint64_t code, int64_t entry) {
  return (code << kSendErrorShift) | static_cast<uint64_t>(entry);
}

// The checks of one used entry (dest >= 0) against its destination, in the order the send makes
// them: 0 when it may be sent, else the code. Shared by the device's send and the CPU reference
// (constexpr: device code calls it with --expt-relaxed-constexpr).
constexpr uint64_t send_entry_check(int64_t dest, int64_t row, int64_t counter, int64_t num_peers,
                                    int64_t rows_capacity, int64_t num_counters) {
  return dest >= num_peers                        ? kSendBadPeer
         : row < 0 || row >= rows_capacity        ? kSendRowOutOfRange
         : counter < 0 || counter >= num_counters ? kSendCounterOutOfRange
                                                  : 0;
}

// The Status of an error word of plan_sender_rows_async / send_rows_async; OK for 0.
inline Status send_rows_error_status(uint64_t word, int64_t top_k, const char* what) {
  if (word == 0) return Status::Ok();
  const uint64_t code = word >> kSendErrorShift;
  const int64_t entry = static_cast<int64_t>(word & ((uint64_t{1} << kSendErrorShift) - 1));
  const int64_t t = top_k > 0 ? entry / top_k : entry, k = top_k > 0 ? entry % top_k : 0;
  const char* why = code == kSendBadExpert       ? "holds an expert id outside [-1, num_experts)"
                    : code == kSendOverCount     ? "routes more rows to its expert than the rank's "
                                                   "announced count"
                    : code == kSendBadPeer       ? "goes to a rank outside the peer table"
                    : code == kSendRowOutOfRange ? "has a GEMM row outside the destination's rows"
                    : code == kSendCounterOutOfRange
                        ? "has a gate counter outside the destination's counters"
                        : "failed an unknown check";
  return {StatusCode::kInvalidArgument,
          detail::str_cat(what, ": entry (token ", t, ", k ", k, ") ", why, "; it was not sent")};
}

}  // namespace uniep
