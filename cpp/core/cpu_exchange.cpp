#include "core/cpu_exchange.hpp"

#include <cstring>
#include <string>

#include "uniep/status.hpp"

namespace uniep::cpu {

AgreedPlan agree_on_plan(const int64_t* topk_idx, const MoeShape& shape,
                         const std::vector<HeaderField>& header, Transport& transport) {
  const int64_t W = shape.world_size, E = shape.num_experts, F = header.size();
  UNIEP_CHECK_CODE(transport.world_size() == W && transport.rank() == shape.rank,
                   StatusCode::kInternal, "transport and shape disagree on world size or rank");
  AgreedPlan plan;
  // A rank with bad routing must not leave its peers blocked in the exchange below: its
  // verdict travels with the header, and every rank fails together.
  std::string local_error;
  try {
    plan.layout = compute_layout(topk_idx, shape);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    local_error = e.what();
  }

  // Header first, so a rank with another shape fails here with a clear message, never in a
  // buffer sized from someone else's counts. The last word is 1 when the routing was valid.
  const int64_t G = F + 1;
  std::vector<int64_t> mine(G);
  for (int64_t i = 0; i < F; ++i) mine[i] = header[i].value;
  mine[F] = local_error.empty() ? 1 : 0;
  std::vector<int64_t> all(W * G);
  transport.all_gather(mine.data(), G, all.data());
  UNIEP_CHECK(local_error.empty(), local_error);
  for (int64_t r = 0; r < W; ++r) {
    UNIEP_CHECK(all[r * G + F] == 1, "rank ", r,
                " passed an invalid topk_idx (an expert id outside [-1, ", E,
                ")); its error names the entry");
  }
  for (int64_t r = 1; r < W; ++r) {
    for (int64_t i = 0; i < F; ++i) {
      const int64_t first = all[i], theirs = all[r * G + i];
      if (theirs == first) continue;
      const HeaderField& f = header[i];
      auto show = [&](int64_t v) { return f.value_name ? f.value_name(v) : std::to_string(v); };
      UNIEP_CHECK(false, f.name, " differs across ranks: rank 0 has ", show(first), ", rank ", r,
                  " has ", show(theirs));
    }
  }

  const int64_t C = W + E;
  std::vector<int64_t> counts(C);
  std::memcpy(counts.data(), plan.layout.tokens_per_rank.data(), W * sizeof(int64_t));
  std::memcpy(counts.data() + W, plan.layout.tokens_per_expert.data(), E * sizeof(int64_t));
  std::vector<int64_t> gathered(W * C);
  transport.all_gather(counts.data(), C, gathered.data());
  plan.rank_counts.resize(W * W);
  plan.expert_counts.resize(W * E);
  for (int64_t r = 0; r < W; ++r) {
    std::memcpy(&plan.rank_counts[r * W], &gathered[r * C], W * sizeof(int64_t));
    std::memcpy(&plan.expert_counts[r * E], &gathered[r * C + W], E * sizeof(int64_t));
  }
  plan.slots = plan_slots(plan.layout, plan.rank_counts.data(), shape);
  return plan;
}

namespace {

// Records laid out by rank ranges on both sides: `out` holds the ranges this rank sends
// (out_offsets, [W + 1] in records), `in` the ones it receives. fill(i, rec) writes record i.
std::vector<uint8_t> exchange_ranges(const std::vector<int64_t>& out_offsets,
                                     const std::vector<int64_t>& in_offsets, int64_t record_bytes,
                                     const std::function<void(int64_t, uint8_t*)>& fill,
                                     Transport& transport) {
  const int64_t W = static_cast<int64_t>(out_offsets.size()) - 1;
  UNIEP_CHECK_CODE(record_bytes % 8 == 0, StatusCode::kInternal,
                   "records must be 8-byte multiples");
  std::vector<uint8_t> send(out_offsets[W] * record_bytes);
  for (int64_t i = 0; i < out_offsets[W]; ++i) fill(i, &send[i * record_bytes]);
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  for (int64_t r = 0; r < W; ++r) {
    send_bytes[r] = (out_offsets[r + 1] - out_offsets[r]) * record_bytes;
    recv_bytes[r] = (in_offsets[r + 1] - in_offsets[r]) * record_bytes;
  }
  std::vector<uint8_t> recv(in_offsets[W] * record_bytes);
  transport.all_to_all(send.data(), send_bytes, recv.data(), recv_bytes);
  return recv;
}

}  // namespace

std::vector<uint8_t> dispatch_records(const SlotPlan& slots, int64_t record_bytes,
                                      const std::function<void(int64_t, uint8_t*)>& fill,
                                      Transport& transport) {
  // Entries are grouped by destination and, within it, in slot order: the byte ranges the
  // all-to-all delivers concatenate into exactly the receiver's slot order.
  return exchange_ranges(
      slots.send_offsets, slots.recv_offsets, record_bytes,
      [&](int64_t i, uint8_t* rec) { fill(slots.send_tokens[i], rec); }, transport);
}

std::vector<uint8_t> return_slot_records(const SlotPlan& slots, int64_t record_bytes,
                                         const std::function<void(int64_t, uint8_t*)>& fill,
                                         Transport& transport) {
  // Slots are already grouped by source rank, and each source's tokens in the order it sent
  // them: the all-to-all's byte ranges land in exactly the source's send order.
  return exchange_ranges(slots.recv_offsets, slots.send_offsets, record_bytes, fill, transport);
}

std::vector<int64_t> rows_expected_back(const RoutingLayout& layout, const MoeShape& shape) {
  std::vector<int64_t> expected(shape.world_size, 0);
  for (int64_t e = 0; e < shape.num_experts; ++e)
    expected[shape.rank_of_expert(e)] += layout.tokens_per_expert[e];
  return expected;
}

std::vector<uint8_t> return_records(const ExpertPlan& experts, int64_t record_bytes,
                                    const std::function<void(int64_t, uint8_t*)>& fill,
                                    const std::vector<int64_t>& expected, Transport& transport) {
  const int64_t W = experts.return_counts.size(), R = experts.num_rows();
  UNIEP_CHECK_CODE(record_bytes % 8 == 0, StatusCode::kInternal,
                   "records must be 8-byte multiples");
  std::vector<int64_t> offsets(W + 1, 0);
  for (int64_t s = 0; s < W; ++s) offsets[s + 1] = offsets[s] + experts.return_counts[s];
  std::vector<uint8_t> send(R * record_bytes);
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t row = 0; row < R; ++row) {
    uint8_t* rec = &send[cursor[experts.row_src_rank[row]]++ * record_bytes];
    std::memcpy(rec, &experts.row_combine_slot[row], sizeof(int64_t));
    fill(row, rec + sizeof(int64_t));
  }
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  int64_t total = 0;
  for (int64_t r = 0; r < W; ++r) {
    send_bytes[r] = experts.return_counts[r] * record_bytes;
    recv_bytes[r] = expected[r] * record_bytes;
    total += expected[r];
  }
  std::vector<uint8_t> recv(total * record_bytes);
  transport.all_to_all(send.data(), send_bytes, recv.data(), recv_bytes);
  return recv;
}

}  // namespace uniep::cpu
