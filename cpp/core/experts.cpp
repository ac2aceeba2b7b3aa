#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace uniep {

std::vector<int64_t> expert_source_offsets(const int64_t* expert_counts, const MoeShape& shape) {
  shape.validate();
  UNIEP_CHECK(expert_counts != nullptr, "expert_counts must not be null");
  const int64_t W = shape.world_size, El = shape.experts_per_rank(), E = shape.num_experts;
  const int64_t first = shape.first_local_expert(), K = shape.top_k;
  // The counts are what the peers announced: a corrupt one must not size or index anything. A
  // rank holds at most kMaxTokens tokens of K entries, so no count exceeds kMaxTokens * K (2**52
  // at the bounds); the rows of one rank stay below 2**62, so the sum cannot wrap either.
  constexpr int64_t kMaxRows = int64_t{1} << 62;
  std::vector<int64_t> offsets(El * (W + 1), 0);
  int64_t row = 0;
  for (int64_t e = 0; e < El; ++e) {
    for (int64_t s = 0; s < W; ++s) {
      offsets[e * (W + 1) + s] = row;
      const int64_t g = first + e, count = expert_counts[s * E + g];
      UNIEP_CHECK(count >= 0 && count <= kMaxTokens * K, "expert_counts[", s, "][", g,
                  "] (rows rank ", s, " announced for expert ", g,
                  ") must be in [0, 2**32 * top_k = ", kMaxTokens * K, "], got ", count);
      row += count;
      UNIEP_CHECK(row < kMaxRows, "expert_counts: the experts of rank ", shape.rank,
                  " would hold more than 2**62 rows");
    }
    offsets[e * (W + 1) + W] = row;
  }
  return offsets;
}

SenderRows plan_sender_rows(const int64_t* topk_idx, const int64_t* expert_counts,
                            const MoeShape& shape, int64_t tile_m) {
  shape.validate();
  const int64_t T = shape.tokens, K = shape.top_k, E = shape.num_experts, W = shape.world_size;
  const int64_t El = shape.experts_per_rank(), me = shape.rank;
  UNIEP_CHECK(tile_m >= 1, "tile_m must be >= 1, got ", tile_m);
  UNIEP_CHECK(T == 0 || topk_idx != nullptr, "topk_idx must not be null");
  UNIEP_CHECK(expert_counts != nullptr, "expert_counts must not be null");
  SenderRows out;
  out.dest_rank.assign(T * K, -1);
  out.gemm_row.assign(T * K, -1);
  out.counter.assign(T * K, -1);
  // Per global expert g on its rank r: the first row of (g, source me), the first row of g and
  // g's first gate counter, from r's expert_source_offsets and the gate's tiles over them.
  std::vector<int64_t> next(E, 0), first_row(E, 0), first_tile(E, 0);
  MoeShape there = shape;
  std::vector<int32_t> ends(El);
  for (int64_t r = 0; r < W; ++r) {
    there.rank = r;
    const std::vector<int64_t> offsets = expert_source_offsets(expert_counts, there);
    UNIEP_CHECK(offsets.back() < (int64_t{1} << 31), "expert_counts: rank ", r, " would hold ",
                offsets.back(), " GEMM rows, more than the grouped GEMM's int32 rows");
    for (int64_t e = 0; e < El; ++e) ends[e] = static_cast<int32_t>(offsets[e * (W + 1) + W]);
    const std::vector<int32_t> tiles = gate_tile_base(ends.data(), El, ends[El - 1], tile_m);
    for (int64_t e = 0; e < El; ++e) {
      next[r * El + e] = offsets[e * (W + 1) + me];
      first_row[r * El + e] = offsets[e * (W + 1)];
      first_tile[r * El + e] = tiles[e];
    }
  }
  // Where each expert's entries start in the send order: the announced counts of the experts
  // before it in (index on its rank, rank) order.
  std::vector<int64_t> order_base(E, 0);
  for (int64_t el = 0, at = 0; el < El; ++el)
    for (int64_t r = 0; r < W; ++r) {
      order_base[r * El + el] = at;
      at += expert_counts[me * E + r * El + el];
    }
  out.send_order.assign(T * K, -1);
  std::vector<int64_t> sent(E, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t g = topk_idx[i];
    if (g == -1) continue;
    // A failing entry is recorded and skipped, as the device's plan does: the rest is planned.
    const uint64_t code = g < -1 || g >= E                       ? kSendBadExpert
                          : sent[g] >= expert_counts[me * E + g] ? kSendOverCount
                                                                 : 0;
    if (code != 0) {
      if (out.error == 0) out.error = send_error_word(code, i);
      continue;
    }
    // Counts that announce more than the routing holds leave holes and may run past the end.
    if (order_base[g] + sent[g] < T * K) out.send_order[order_base[g] + sent[g]] = i;
    const int64_t row = next[g] + sent[g]++;
    out.dest_rank[i] = g / El;
    out.gemm_row[i] = row;
    out.counter[i] = first_tile[g] + (row - first_row[g]) / tile_m;
  }
  return out;
}

ExpertPlan plan_experts(const SlotPlan& slots, const int64_t* recv_src_token,
                        const int64_t* recv_topk_idx, const int64_t* expert_counts,
                        const MoeShape& shape) {
  shape.validate();
  const int64_t W = shape.world_size, K = shape.top_k, El = shape.experts_per_rank();
  UNIEP_CHECK(static_cast<int64_t>(slots.recv_offsets.size()) == W + 1,
              "slots.recv_offsets must have world_size + 1 (", W + 1, ") entries, got ",
              slots.recv_offsets.size());
  UNIEP_CHECK(slots.recv_offsets[0] == 0, "slots.recv_offsets[0] must be 0, got ",
              slots.recv_offsets[0]);
  for (int64_t s = 0; s < W; ++s) {
    const int64_t from_s = slots.recv_offsets[s + 1] - slots.recv_offsets[s];
    UNIEP_CHECK(from_s >= 0 && from_s <= kMaxTokens, "slots.recv_offsets: source rank ", s,
                " must send [0, 2**32] tokens, got ", from_s);
  }
  const int64_t first = shape.first_local_expert(), N = slots.num_recv();
  UNIEP_CHECK(N == 0 || (recv_src_token != nullptr && recv_topk_idx != nullptr),
              "recv_src_token and recv_topk_idx must not be null with ", N, " receive slots");
  ExpertPlan plan;
  plan.num_local_experts = El;
  plan.return_counts.assign(W, 0);

  // Rows per expert come from the announced counts; the metadata must agree, or a peer is
  // corrupt and we would write out of bounds.
  const std::vector<int64_t> src_offsets = expert_source_offsets(expert_counts, shape);
  plan.row_offsets.assign(El + 1, 0);
  for (int64_t e = 0; e < El; ++e) plan.row_offsets[e + 1] = src_offsets[e * (W + 1) + W];
  const int64_t R = plan.row_offsets[El];
  // Each row is one (slot, k) entry, so more announced rows than N * K entries cannot be met;
  // said before sizing anything by R.
  UNIEP_CHECK_CODE(R == 0 || (R - 1) / K < N, StatusCode::kInternal, "expert_counts announce ", R,
                   " rows for the experts of rank ", shape.rank, ", more than its ", N,
                   " receive slots x top_k ", K, " can hold");
  plan.row_slot.assign(R, -1);
  plan.row_src_rank.assign(R, -1);
  plan.row_combine_slot.assign(R, -1);

  std::vector<int64_t> cursor(plan.row_offsets.begin(), plan.row_offsets.end() - 1);
  int64_t src = 0;
  for (int64_t slot = 0; slot < N; ++slot) {
    while (slot >= slots.recv_offsets[src + 1]) ++src;
    const int64_t t = recv_src_token[slot];
    bool any_local = false;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t g = recv_topk_idx[slot * K + k];
      if (g < first || g >= first + El) continue;
      const int64_t e = g - first;
      const int64_t row = cursor[e]++;
      UNIEP_CHECK_CODE(row < plan.row_offsets[e + 1], StatusCode::kInternal, "rank ", src,
                       " sent more rows for local expert ", e, " than it announced");
      plan.row_slot[row] = slot;
      plan.row_src_rank[row] = src;
      plan.row_combine_slot[row] = t * K + k;
      ++plan.return_counts[src];
      any_local = true;
    }
    UNIEP_CHECK_CODE(any_local, StatusCode::kInternal, "receive slot ", slot, " from rank ", src,
                     " routes to no expert of rank ", shape.rank);
  }
  for (int64_t e = 0; e < El; ++e) {
    UNIEP_CHECK_CODE(cursor[e] == plan.row_offsets[e + 1], StatusCode::kInternal, "local expert ",
                     e, " received fewer rows than announced");
  }
  return plan;
}

}  // namespace uniep
