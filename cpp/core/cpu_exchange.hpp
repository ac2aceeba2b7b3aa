// Byte-level exchange steps of the CPU executor, independent of the element type: the count
// exchange that makes every rank agree on the plan, the slot-indexed dispatch, and the return of
// expert rows to their (token, k) combine slots.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "uniep/cpu_executor.hpp"
#include "uniep/plan.hpp"

namespace uniep::cpu {

struct AgreedPlan {
  RoutingLayout layout;
  std::vector<int64_t> rank_counts;    // [W][W]
  std::vector<int64_t> expert_counts;  // [W][E]
  SlotPlan slots;
};

// header: values every rank must agree on (shape, dtypes, precision); a mismatch names the field
// and both ranks instead of corrupting buffers. Every rank raises the same message: rank 0's
// value against the first rank that differs from it.
struct HeaderField {
  const char* name;
  int64_t value;
  // Prints an enum value by its name ("float32", not 0); null: the value is a plain integer.
  const char* (*value_name)(int64_t) = nullptr;
};
AgreedPlan agree_on_plan(const int64_t* topk_idx, const MoeShape& shape,
                         const std::vector<HeaderField>& header, Transport& transport);

// Records are multiples of 8 bytes, so transports may move them as int64 words.
// One record of record_bytes per (token, destination); returns the received records in slot
// order ([num_recv][record_bytes]).
std::vector<uint8_t> dispatch_records(const SlotPlan& slots, int64_t record_bytes,
                                      const std::function<void(int64_t token, uint8_t*)>& fill,
                                      Transport& transport);

// Each expert row's record goes back to its source rank; fill writes the payload after the
// int64 combine slot header (record_bytes includes it). Returns the records this rank gets,
// each starting with the int64 combine slot it belongs to; `expected` is how many rows each
// destination computed for us (from our own layout).
std::vector<uint8_t> return_records(const ExpertPlan& experts, int64_t record_bytes,
                                    const std::function<void(int64_t row, uint8_t*)>& fill,
                                    const std::vector<int64_t>& expected, Transport& transport);

// The reverse of dispatch_records: one record per receive slot goes back to the slot's source
// rank. Returns [num_send][record_bytes] in the order of slots.send_tokens (grouped by the rank
// that answered, ascending, each rank's records in token order).
std::vector<uint8_t> return_slot_records(const SlotPlan& slots, int64_t record_bytes,
                                         const std::function<void(int64_t slot, uint8_t*)>& fill,
                                         Transport& transport);

// Rows each destination rank computes for this rank's tokens: one per valid (t, k).
std::vector<int64_t> rows_expected_back(const RoutingLayout& layout, const MoeShape& shape);

constexpr int64_t align8(int64_t n) {
  return (n + 7) / 8 * 8;
}

}  // namespace uniep::cpu
