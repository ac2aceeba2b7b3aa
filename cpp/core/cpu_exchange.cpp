#include "core/cpu_exchange.hpp"

#include <cstring>
#include <string>

#include "uniep/status.hpp"

namespace uniep::cpu {

namespace {
// The header's last word: 1 when the routing was valid, 0 when it was not, this when the rank's
// other arguments had already failed (fail_plan_agreement).
constexpr int64_t kArgumentsFailed = -1;
}  // namespace

void fail_plan_agreement(const Error& error, int64_t header_fields, Transport& transport) {
  // The transport's size, not the shape's: the shape may be what failed.
  const int64_t W = transport.world_size(), G = header_fields + 1;
  std::vector<int64_t> mine(G, 0), all(W * G);
  mine[header_fields] = kArgumentsFailed;
  transport.all_gather(mine.data(), G, all.data());
  throw error;
}

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
    UNIEP_CHECK(all[r * G + F] != kArgumentsFailed, "rank ", r,
                " failed its argument checks; its error names the argument");
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

  const int64_t N = shape.num_nodes(), C = W + E + N;
  const std::vector<int64_t> per_node = tokens_per_node(plan.layout, shape);
  std::vector<int64_t> counts(C);
  std::memcpy(counts.data(), plan.layout.tokens_per_rank.data(), W * sizeof(int64_t));
  std::memcpy(counts.data() + W, plan.layout.tokens_per_expert.data(), E * sizeof(int64_t));
  std::memcpy(counts.data() + W + E, per_node.data(), N * sizeof(int64_t));
  std::vector<int64_t> gathered(W * C);
  transport.all_gather(counts.data(), C, gathered.data());
  plan.rank_counts.resize(W * W);
  plan.expert_counts.resize(W * E);
  plan.node_counts.resize(W * N);
  for (int64_t r = 0; r < W; ++r) {
    std::memcpy(&plan.rank_counts[r * W], &gathered[r * C], W * sizeof(int64_t));
    std::memcpy(&plan.expert_counts[r * E], &gathered[r * C + W], E * sizeof(int64_t));
    std::memcpy(&plan.node_counts[r * N], &gathered[r * C + W + E], N * sizeof(int64_t));
  }
  plan.slots = plan_slots(plan.layout, plan.rank_counts.data(), shape);
  plan.nodes = plan_nodes(plan.layout, plan.node_counts.data(), shape);
  return plan;
}

namespace {

void check_record_bytes(int64_t record_bytes) {
  UNIEP_CHECK_CODE(record_bytes % 8 == 0, StatusCode::kInternal,
                   "records must be 8-byte multiples");
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  return offsets;
}

// counts[a * W + b] for every a of a column b, or every b of a row a.
std::vector<int64_t> row_of(const std::vector<int64_t>& counts, int64_t a, int64_t W) {
  return {counts.begin() + a * W, counts.begin() + (a + 1) * W};
}
std::vector<int64_t> column_of(const std::vector<int64_t>& counts, int64_t b, int64_t W) {
  std::vector<int64_t> col(W);
  for (int64_t a = 0; a < W; ++a) col[a] = counts[a * W + b];
  return col;
}

// All of one rank's records to every rank, then the matching exchange: flat, or via relays.
std::vector<uint8_t> exchange_matrix(const std::vector<uint8_t>& send,
                                     const std::vector<int64_t>& counts, int64_t record_bytes,
                                     const MoeShape& shape, bool two_level, Transport& transport) {
  const int64_t W = shape.world_size, me = shape.rank;
  if (two_level) return exchange_via_relays(send, counts, record_bytes, shape, transport);
  return exchange_by_rank(send, row_of(counts, me, W), column_of(counts, me, W), record_bytes,
                          transport);
}

}  // namespace

std::vector<uint8_t> exchange_by_rank(const std::vector<uint8_t>& send,
                                      const std::vector<int64_t>& send_counts,
                                      const std::vector<int64_t>& recv_counts, int64_t record_bytes,
                                      Transport& transport) {
  check_record_bytes(record_bytes);
  const int64_t W = send_counts.size();
  std::vector<int64_t> send_bytes(W), recv_bytes(W);
  int64_t sent = 0, total = 0;
  for (int64_t r = 0; r < W; ++r) {
    send_bytes[r] = send_counts[r] * record_bytes;
    recv_bytes[r] = recv_counts[r] * record_bytes;
    sent += send_bytes[r];
    total += recv_bytes[r];
  }
  UNIEP_CHECK_CODE(sent == static_cast<int64_t>(send.size()), StatusCode::kInternal,
                   "exchange: ", send.size(), " bytes to send, the counts say ", sent);
  std::vector<uint8_t> recv(total);
  transport.all_to_all(send.data(), send_bytes, recv.data(), recv_bytes);
  return recv;
}

std::vector<uint8_t> exchange_via_relays(const std::vector<uint8_t>& send,
                                         const std::vector<int64_t>& counts, int64_t record_bytes,
                                         const MoeShape& shape, Transport& transport) {
  const int64_t W = shape.world_size, L = shape.node_size(), N = shape.num_nodes();
  const int64_t me = shape.rank, home = shape.node_of(me), local = shape.local_of(me);
  const int64_t rb = record_bytes;
  auto at = [&](int64_t a, int64_t b) { return counts[a * W + b]; };

  // Leg 1 (NVLink): to relay (home, j) the records for every b = (m, j), m ascending.
  const std::vector<int64_t> mine = offsets_of(row_of(counts, me, W));
  std::vector<uint8_t> out1;
  out1.reserve(send.size());
  std::vector<int64_t> send1(W, 0), recv1(W, 0);
  for (int64_t j = 0; j < L; ++j) {
    for (int64_t m = 0; m < N; ++m) {
      const int64_t b = m * L + j;
      out1.insert(out1.end(), send.begin() + mine[b] * rb, send.begin() + mine[b + 1] * rb);
      send1[home * L + j] += at(me, b);
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    const int64_t a = home * L + i;
    for (int64_t m = 0; m < N; ++m) recv1[a] += at(a, m * L + local);
  }
  const std::vector<uint8_t> in1 = exchange_by_rank(out1, send1, recv1, rb, transport);

  // Leg 2 (rail): to each b = (m, local) the records every a of this node sent it, a ascending.
  // in1 holds, per a (ascending), its records for b = (m, local), m ascending.
  std::vector<int64_t> a_base(L + 1, 0);
  for (int64_t i = 0; i < L; ++i) a_base[i + 1] = a_base[i] + recv1[home * L + i];
  std::vector<uint8_t> out2;
  out2.reserve(in1.size());
  std::vector<int64_t> send2(W, 0), recv2(W, 0);
  for (int64_t m = 0; m < N; ++m) {
    const int64_t b = m * L + local;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t a = home * L + i;
      int64_t skip = 0;
      for (int64_t mm = 0; mm < m; ++mm) skip += at(a, mm * L + local);
      const int64_t begin = (a_base[i] + skip) * rb, n = at(a, b) * rb;
      out2.insert(out2.end(), in1.begin() + begin, in1.begin() + begin + n);
      send2[b] += at(a, b);
    }
  }
  for (int64_t m = 0; m < N; ++m) {
    for (int64_t i = 0; i < L; ++i) recv2[m * L + local] += at(m * L + i, me);
  }
  // From relay (m, local) the records of the sources of node m, ascending: concatenated over m,
  // every source ascending, as a flat exchange returns them.
  return exchange_by_rank(out2, send2, recv2, rb, transport);
}

Dispatched dispatch_records(const AgreedPlan& plan, const MoeShape& shape, int64_t record_bytes,
                            int64_t topk_offset, const std::function<void(int64_t, uint8_t*)>& fill,
                            bool two_level, Transport& transport) {
  check_record_bytes(record_bytes);
  const int64_t W = shape.world_size, L = shape.node_size(), N = shape.num_nodes();
  const int64_t K = shape.top_k, me = shape.rank, home = shape.node_of(me);
  const int64_t rb = record_bytes;
  const SlotPlan& slots = plan.slots;
  Dispatched out;
  if (!two_level) {
    // Entries are grouped by destination and, within it, in slot order: the byte ranges the
    // all-to-all delivers concatenate into exactly the receiver's slot order.
    std::vector<uint8_t> send(slots.num_send() * rb);
    for (int64_t i = 0; i < slots.num_send(); ++i) fill(slots.send_tokens[i], &send[i * rb]);
    std::vector<int64_t> send_counts(W), recv_counts(W);
    for (int64_t r = 0; r < W; ++r) {
      send_counts[r] = slots.send_offsets[r + 1] - slots.send_offsets[r];
      recv_counts[r] = slots.recv_offsets[r + 1] - slots.recv_offsets[r];
    }
    out.records = exchange_by_rank(send, send_counts, recv_counts, rb, transport);
    return out;
  }

  // Leg 1 (rail): each token once to the relay of every node it is bound for.
  const NodePlan& nodes = plan.nodes;
  std::vector<uint8_t> send(nodes.num_send() * rb);
  for (int64_t i = 0; i < nodes.num_send(); ++i) fill(nodes.send_tokens[i], &send[i * rb]);
  std::vector<int64_t> send1(W, 0), recv1(W, 0);
  for (int64_t m = 0; m < N; ++m) {
    const int64_t peer = nodes.relay_source(m, me);
    send1[peer] = nodes.send_offsets[m + 1] - nodes.send_offsets[m];
    recv1[peer] = nodes.relay_offsets[m + 1] - nodes.relay_offsets[m];
  }
  out.relayed = exchange_by_rank(send, send1, recv1, rb, transport);

  // Leg 2 (NVLink): the relay forwards each row to the ranks of its node its routing names.
  const int64_t R = nodes.num_relayed();
  std::vector<int64_t> topk(R * K);
  for (int64_t i = 0; i < R; ++i)
    std::memcpy(&topk[i * K], &out.relayed[i * rb + topk_offset], K * sizeof(int64_t));
  const RelayPlan relay = plan_relay(nodes, topk.data(), plan.rank_counts.data(), shape);
  std::vector<uint8_t> send2(relay.rows.size() * rb);
  for (size_t i = 0; i < relay.rows.size(); ++i)
    std::memcpy(&send2[i * rb], &out.relayed[relay.rows[i] * rb], rb);
  std::vector<int64_t> send2_counts(W, 0), recv2_counts(W, 0);
  for (int64_t j = 0; j < L; ++j) {
    const int64_t d = home * L + j;
    send2_counts[d] = relay.offsets[j + 1] - relay.offsets[j];
    for (int64_t m = 0; m < N; ++m) recv2_counts[d] += plan.rank_counts[(m * L + j) * W + me];
  }
  const std::vector<uint8_t> arrived =
      exchange_by_rank(send2, send2_counts, recv2_counts, rb, transport);
  const std::vector<int64_t> order = relayed_slot_order(plan.rank_counts.data(), shape);
  out.records.resize(slots.num_recv() * rb);
  for (size_t i = 0; i < order.size(); ++i)
    std::memcpy(&out.records[order[i] * rb], &arrived[i * rb], rb);
  return out;
}

std::vector<uint8_t> return_slot_records(const AgreedPlan& plan, const MoeShape& shape,
                                         int64_t record_bytes,
                                         const std::function<void(int64_t, uint8_t*)>& fill,
                                         bool two_level, Transport& transport) {
  // Slots are already grouped by source rank, and each source's tokens in the order it sent
  // them: the exchange's ranges land in exactly the source's send order.
  check_record_bytes(record_bytes);
  const int64_t W = shape.world_size, N = plan.slots.num_recv();
  std::vector<uint8_t> send(N * record_bytes);
  for (int64_t n = 0; n < N; ++n) fill(n, &send[n * record_bytes]);
  // counts[e * W + s]: slots rank e holds for source s, what s sent e.
  std::vector<int64_t> counts(W * W);
  for (int64_t e = 0; e < W; ++e)
    for (int64_t s = 0; s < W; ++s) counts[e * W + s] = plan.rank_counts[s * W + e];
  return exchange_matrix(send, counts, record_bytes, shape, two_level, transport);
}

std::vector<int64_t> rows_by_rank(const std::vector<int64_t>& expert_counts,
                                  const MoeShape& shape) {
  const int64_t W = shape.world_size, E = shape.num_experts;
  std::vector<int64_t> rows(W * W, 0);
  for (int64_t s = 0; s < W; ++s)
    for (int64_t g = 0; g < E; ++g)
      rows[shape.rank_of_expert(g) * W + s] += expert_counts[s * E + g];
  return rows;
}

std::vector<uint8_t> return_records(const AgreedPlan& plan, const ExpertPlan& experts,
                                    const MoeShape& shape, int64_t record_bytes,
                                    const std::function<void(int64_t, uint8_t*)>& fill,
                                    bool two_level, Transport& transport) {
  check_record_bytes(record_bytes);
  const int64_t W = shape.world_size, R = experts.num_rows(), me = shape.rank;
  const std::vector<int64_t> counts = rows_by_rank(plan.expert_counts, shape);
  for (int64_t s = 0; s < W; ++s) {
    UNIEP_CHECK_CODE(experts.return_counts[s] == counts[me * W + s], StatusCode::kInternal, "rank ",
                     me, " computed ", experts.return_counts[s], " rows for rank ", s,
                     ", whose counts announced ", counts[me * W + s]);
  }
  const std::vector<int64_t> offsets = offsets_of(experts.return_counts);
  std::vector<uint8_t> send(R * record_bytes);
  std::vector<int64_t> cursor(offsets.begin(), offsets.end() - 1);
  for (int64_t row = 0; row < R; ++row) {
    uint8_t* rec = &send[cursor[experts.row_src_rank[row]]++ * record_bytes];
    std::memcpy(rec, &experts.row_combine_slot[row], sizeof(int64_t));
    fill(row, rec + sizeof(int64_t));
  }
  return exchange_matrix(send, counts, record_bytes, shape, two_level, transport);
}

}  // namespace uniep::cpu
