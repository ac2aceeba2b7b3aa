// Byte-level exchange steps of the CPU executor, independent of the element type: the count
// exchange that makes every rank agree on the plan, the slot-indexed dispatch, and the return of
// expert rows to their (token, k) combine slots. Each step runs flat (one all-to-all over the
// group) or in two levels when the group spans nodes (uniep/node_plan.hpp): the same records
// arrive in the same order either way.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "uniep/cpu_executor.hpp"
#include "uniep/node_plan.hpp"
#include "uniep/plan.hpp"

namespace uniep::cpu {

struct AgreedPlan {
  RoutingLayout layout;
  std::vector<int64_t> rank_counts;    // [W][W]
  std::vector<int64_t> expert_counts;  // [W][E]
  std::vector<int64_t> node_counts;    // [W][N] tokens_per_node of every rank
  SlotPlan slots;
  NodePlan nodes;
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

// For a rank whose arguments failed their checks before agree_on_plan (`error`, a bad argument):
// it joins the header's exchange (of `header_fields` fields, as its peers send) marked failed, so
// they raise at once naming it instead of waiting for it, then rethrows `error`.
[[noreturn]] void fail_plan_agreement(const Error& error, int64_t header_fields,
                                      Transport& transport);

// Records are multiples of 8 bytes, so transports may move them as int64 words.

// One leg: this rank's records grouped by destination rank (send_counts[r] of them to rank r)
// go out; recv_counts[r] records come from rank r, returned grouped by source rank.
std::vector<uint8_t> exchange_by_rank(const std::vector<uint8_t>& send,
                                      const std::vector<int64_t>& send_counts,
                                      const std::vector<int64_t>& recv_counts, int64_t record_bytes,
                                      Transport& transport);

// Records from every rank a to every rank b, counts [W][W] (counts[a * W + b]), in two legs:
// over NVLink to the relay (node(a), local(b)), then on the rail to b. send: this rank's
// records grouped by destination. Returns what a flat all-to-all returns: the records from
// every source, grouped by source rank ascending, each source's in its send order.
std::vector<uint8_t> exchange_via_relays(const std::vector<uint8_t>& send,
                                         const std::vector<int64_t>& counts, int64_t record_bytes,
                                         const MoeShape& shape, Transport& transport);

// The dispatch: one record of record_bytes per (token, destination rank) arrives, in slot order
// ([num_recv][record_bytes]). fill(token, rec) writes a token's record; the record holds the
// token's routing (K int64 global expert ids) at topk_offset. Two levels: fill runs once per
// (token, destination node), the record crosses to the node's relay on the rail and the relay
// forwards it to the ranks of its node its routing names; `relayed` then keeps the records the
// relay forwarded, in NodePlan's relay order.
struct Dispatched {
  std::vector<uint8_t> records;
  std::vector<uint8_t> relayed;
};
Dispatched dispatch_records(const AgreedPlan& plan, const MoeShape& shape, int64_t record_bytes,
                            int64_t topk_offset,
                            const std::function<void(int64_t token, uint8_t*)>& fill,
                            bool two_level, Transport& transport);

// Each expert row's record goes back to its source rank; fill writes the payload after the
// int64 combine slot header (record_bytes includes it). Returns the records this rank gets,
// each starting with the int64 combine slot it belongs to.
std::vector<uint8_t> return_records(const AgreedPlan& plan, const ExpertPlan& experts,
                                    const MoeShape& shape, int64_t record_bytes,
                                    const std::function<void(int64_t row, uint8_t*)>& fill,
                                    bool two_level, Transport& transport);

// The reverse of dispatch_records: one record per receive slot goes back to the slot's source
// rank. Returns [num_send][record_bytes] in the order of slots.send_tokens (grouped by the rank
// that answered, ascending, each rank's records in token order).
std::vector<uint8_t> return_slot_records(const AgreedPlan& plan, const MoeShape& shape,
                                         int64_t record_bytes,
                                         const std::function<void(int64_t slot, uint8_t*)>& fill,
                                         bool two_level, Transport& transport);

// rows[e * W + s]: the expert rows rank e computes for rank s's tokens (one per valid (t, k)
// routed to e's experts), from every rank's tokens_per_expert.
std::vector<int64_t> rows_by_rank(const std::vector<int64_t>& expert_counts, const MoeShape& shape);

constexpr int64_t align8(int64_t n) {
  return (n + 7) / 8 * 8;
}

}  // namespace uniep::cpu
