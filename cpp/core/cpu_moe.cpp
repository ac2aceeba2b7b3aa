// The CPU executor: agree on the plan, dispatch tokens into their receive slots, run the local
// experts tile by tile in the schedule's order, return each row to its (token, k) combine slot and
// reduce over k in ascending order (or, with combine=rank_partials, reduce each rank's k's where
// the experts ran and the per-rank partials at home; with combine=node_partials, each node's k's
// on the token's relay there and the per-node partials at home). A group that spans nodes moves
// every step in two levels (uniep/node_plan.hpp): the same records, the same bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cpu_exchange.hpp"
#include "core/cpu_math.hpp"
#include "core/cpu_wire.hpp"
#include "core/numeric.hpp"
#include "uniep/cpu_executor.hpp"
#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace uniep {
namespace {

using cpu::ExpertWeights;
using cpu::vec_mat_t;
using numeric::Bf16;
using numeric::Storage;

enum class Pass : int64_t { kForward = 0, kBackward = 1 };

const char* pass_name(Pass pass) {
  return pass == Pass::kForward ? "forward" : pass == Pass::kBackward ? "backward" : "?";
}

// A header field printed by the name of its enum value, through `name_of` (dtype_name, ...).
template <typename Enum, const char* (*name_of)(Enum)>
cpu::HeaderField enum_field(const char* name, Enum value) {
  return {name, static_cast<int64_t>(value),
          [](int64_t v) { return name_of(static_cast<Enum>(v)); }};
}

std::vector<cpu::HeaderField> header_of(const MoeForwardArgs& a, Pass pass) {
  return {{"hidden", a.shape.hidden},
          {"ffn_hidden", a.shape.ffn_hidden},
          {"top_k", a.shape.top_k},
          {"num_experts", a.shape.num_experts},
          {"ranks_per_node", a.shape.node_size()},
          enum_field<DType, dtype_name>("dtype", a.dtype),
          enum_field<DType, dtype_name>("topk_weights dtype", a.weight_dtype),
          enum_field<DispatchPrecision, dispatch_precision_name>("tuning dispatch precision",
                                                                 a.tuning.dispatch),
          enum_field<CombineReduction, combine_reduction_name>("tuning combine reduction",
                                                               a.tuning.combine),
          {"tuning experts (fp8 GEMMs)", a.tuning.fp8_experts() ? 1 : 0,
           [](int64_t v) { return v != 0 ? "fp8" : "bf16"; }},
          enum_field<Pass, pass_name>("pass (forward/backward)", pass)};
}

// Routing weights are promoted here, on read: a bf16 router's weights need no cast before the op.
template <typename Acc>
Acc load_weight(const MoeForwardArgs& a, int64_t i) {
  if (a.weight_dtype == DType::kFloat64) return Acc(static_cast<const double*>(a.topk_weights)[i]);
  if (a.weight_dtype == DType::kBFloat16)
    return Acc(numeric::bf16_to_float(static_cast<const Bf16*>(a.topk_weights)[i]));
  return Acc(static_cast<const float*>(a.topk_weights)[i]);
}

void store_weight(const MoeForwardArgs& a, void* out, int64_t i, double v) {
  if (a.weight_dtype == DType::kFloat64)
    static_cast<double*>(out)[i] = v;
  else if (a.weight_dtype == DType::kBFloat16)
    static_cast<Bf16*>(out)[i] = numeric::float_to_bf16(static_cast<float>(v));
  else
    static_cast<float*>(out)[i] = static_cast<float>(v);
}

// Everything a rank knows once the tokens have arrived.
template <typename S>
struct Received {
  cpu::AgreedPlan plan;
  ExpertPlan experts;
  std::vector<WorkTile> tiles;
  std::vector<int64_t> src_token, topk;  // [N], [N][K]
  std::vector<S> x;                      // [N][H], decoded
  std::vector<uint8_t> raw;              // the records, for extra payload
  std::vector<uint8_t> relayed;          // two levels: the records this rank relayed
  int64_t record_bytes = 0, extra_offset = 0;
  bool two_level = false;
};

// Two levels when the group spans nodes, and for node partials (reduced on the relays) always.
bool two_level(const MoeForwardArgs& a) {
  return a.shape.spans_nodes() || a.tuning.combine == CombineReduction::kNodePartials;
}

// decode_rows false: the rows stay in `raw` only (fp8 experts decode them unrounded themselves).
template <typename S>
Received<S> dispatch(const MoeForwardArgs& a, Pass pass, int64_t extra_bytes,
                     const std::function<void(int64_t, uint8_t*)>& fill_extra, Transport& tr,
                     bool decode_rows = true) {
  const MoeShape& sh = a.shape;
  const int64_t H = sh.hidden, K = sh.top_k;
  const DispatchPrecision prec = a.tuning.dispatch;
  Received<S> r;
  r.plan = cpu::agree_on_plan(a.topk_idx, sh, header_of(a, pass), tr);
  const int64_t row_bytes = cpu::wire_row_bytes<S>(H, prec);
  const int64_t meta_bytes = int64_t(sizeof(int64_t)) * (1 + K);
  r.extra_offset = row_bytes + meta_bytes;
  r.record_bytes = r.extra_offset + extra_bytes;
  r.two_level = two_level(a);
  const S* x = static_cast<const S*>(a.x);
  cpu::Dispatched d = cpu::dispatch_records(
      r.plan, sh, r.record_bytes, row_bytes + int64_t(sizeof(int64_t)),
      [&](int64_t t, uint8_t* rec) {
        cpu::encode_row(x + t * H, H, prec, rec);
        std::memcpy(rec + row_bytes, &t, sizeof t);
        std::memcpy(rec + row_bytes + sizeof t, a.topk_idx + t * K, K * sizeof(int64_t));
        if (extra_bytes) fill_extra(t, rec + r.extra_offset);
      },
      r.two_level, tr);
  r.raw = std::move(d.records);
  r.relayed = std::move(d.relayed);
  const int64_t N = r.plan.slots.num_recv();
  r.src_token.resize(N);
  r.topk.resize(N * K);
  if (decode_rows) r.x.resize(N * H);
  for (int64_t s = 0; s < N; ++s) {
    const uint8_t* rec = &r.raw[s * r.record_bytes];
    if (decode_rows) cpu::decode_row(rec, H, prec, &r.x[s * H]);
    std::memcpy(&r.src_token[s], rec + row_bytes, sizeof(int64_t));
    std::memcpy(&r.topk[s * K], rec + row_bytes + sizeof(int64_t), K * sizeof(int64_t));
  }
  r.experts = plan_experts(r.plan.slots, r.src_token.data(), r.topk.data(),
                           r.plan.expert_counts.data(), sh);
  r.tiles = schedule_expert_tiles(r.experts, expert_source_offsets(r.plan.expert_counts.data(), sh),
                                  a.tuning, sh);
  return r;
}

// Brings each row's payload back to its (token, k) slot. Every valid (token, k) must be filled
// exactly once: a missing row is an error, never a silently dropped token.
template <typename S, typename Filler, typename Sink>
void combine(const MoeForwardArgs& a, const Received<S>& r, int64_t payload_bytes, Filler fill,
             Sink sink, Transport& tr) {
  const int64_t T = a.shape.tokens, K = a.shape.top_k;
  const int64_t rec = int64_t(sizeof(int64_t)) + payload_bytes;
  const std::vector<uint8_t> back =
      cpu::return_records(r.plan, r.experts, a.shape, rec, fill, r.two_level, tr);
  std::vector<uint8_t> filled(T * K, 0);
  for (size_t off = 0; off < back.size(); off += rec) {
    int64_t slot;
    std::memcpy(&slot, &back[off], sizeof slot);
    UNIEP_CHECK_CODE(slot >= 0 && slot < T * K && a.topk_idx[slot] >= 0 && !filled[slot],
                     StatusCode::kInternal, "combine received a row for invalid or repeated slot ",
                     slot);
    filled[slot] = 1;
    sink(slot, &back[off + sizeof(int64_t)]);
  }
  for (int64_t i = 0; i < T * K; ++i) {
    UNIEP_CHECK_CODE(a.topk_idx[i] < 0 || filled[i], StatusCode::kInternal, "combine: token ",
                     i / K, " choice ", i % K, " (expert ", a.topk_idx[i], ") got no result back");
  }
}

// combine=rank_partials: each receive slot's local rows summed here (k ascending, fp32, weights
// applied, one rounding to S), one partial per (token, rank) sent home, summed there in ascending
// rank order. The rows are the second product's outputs as accumulated (`y` in Acc, never rounded
// to S): the partial's one rounding takes the place of the rows' own, so one row per (token,
// rank) costs no accuracy against per_k's one row per (token, k). The same order as the CUDA
// executor's, so the two give the same bits.
template <typename S>
void combine_rank_partials(const MoeForwardArgs& a, const Received<S>& r,
                           const std::vector<typename Storage<S>::Acc>& y, int64_t weights_offset,
                           Transport& tr) {
  using St = Storage<S>;
  using Acc = typename St::Acc;
  const MoeShape& sh = a.shape;
  const int64_t T = sh.tokens, H = sh.hidden, K = sh.top_k, N = r.plan.slots.num_recv();
  std::vector<int64_t> row_of(N * K, -1);  // grouped-GEMM row of (slot, k)
  for (int64_t row = 0; row < r.experts.num_rows(); ++row)
    row_of[r.experts.row_slot[row] * K + r.experts.row_combine_slot[row] % K] = row;
  const int64_t part_bytes = cpu::align8(H * sizeof(S));
  std::vector<Acc> acc(H);
  const std::vector<uint8_t> back = cpu::return_slot_records(
      r.plan, sh, part_bytes,
      [&](int64_t n, uint8_t* p) {
        std::fill(acc.begin(), acc.end(), Acc(0));
        const uint8_t* weights = &r.raw[n * r.record_bytes + weights_offset];
        for (int64_t k = 0; k < K; ++k) {
          const int64_t row = row_of[n * K + k];
          if (row < 0) continue;
          Acc wk;
          std::memcpy(&wk, weights + k * sizeof(Acc), sizeof(Acc));
          for (int64_t c = 0; c < H; ++c) acc[c] += wk * y[row * H + c];
        }
        S* part = reinterpret_cast<S*>(p);
        for (int64_t c = 0; c < H; ++c) part[c] = St::store(acc[c]);
      },
      r.two_level, tr);

  // Our send order is rank-major, so walking it rank by rank adds each token's partials in
  // ascending rank order.
  std::vector<Acc> sum(T * H, Acc(0));
  const SlotPlan& slots = r.plan.slots;
  for (int64_t i = 0; i < slots.num_send(); ++i) {
    const S* part = reinterpret_cast<const S*>(&back[i * part_bytes]);
    Acc* dst = &sum[slots.send_tokens[i] * H];
    for (int64_t c = 0; c < H; ++c) dst[c] += St::load(part[c]);
  }
  S* out = static_cast<S*>(a.out);
  for (int64_t i = 0; i < T * H; ++i) out[i] = St::store(sum[i]);
}

// combine=node_partials: every expert row goes over NVLink to the relay that forwarded its
// token into this node; the relay sums the node's rows of the token (k ascending, fp32, weights
// applied, one rounding to S) and sends one partial per (token, node) on the rail, and the
// token's rank sums the partials in ascending node order. On one node the relay is the token's
// own rank and the one partial is per_k's sum, rounded once more to what it already is: the same
// bits as per_k.
template <typename S>
void combine_node_partials(const MoeForwardArgs& a, const Received<S>& r, const std::vector<S>& y,
                           Transport& tr) {
  using St = Storage<S>;
  using Acc = typename St::Acc;
  const MoeShape& sh = a.shape;
  const int64_t W = sh.world_size, L = sh.node_size(), N = sh.num_nodes();
  const int64_t T = sh.tokens, H = sh.hidden, K = sh.top_k;
  const int64_t me = sh.rank, home = sh.node_of(me), local = sh.local_of(me);
  const cpu::AgreedPlan& plan = r.plan;
  const NodePlan& nodes = plan.nodes;
  const ExpertPlan& ex = r.experts;

  // Leg 1 (NVLink): each row to the relay (home, local(source)), as
  // [source rank][combine slot][row], grouped by relay.
  const int64_t row_bytes = cpu::align8(H * sizeof(S));
  const int64_t rec = 2 * int64_t(sizeof(int64_t)) + row_bytes;
  std::vector<int64_t> send_counts(W, 0), recv_counts(W, 0);
  for (int64_t row = 0; row < ex.num_rows(); ++row)
    ++send_counts[home * L + sh.local_of(ex.row_src_rank[row])];
  const std::vector<int64_t> rows = cpu::rows_by_rank(plan.expert_counts, sh);
  for (int64_t i = 0; i < L; ++i) {
    const int64_t e = home * L + i;
    for (int64_t m = 0; m < N; ++m) recv_counts[e] += rows[e * W + m * L + local];
  }
  std::vector<int64_t> cursor(W, 0);
  for (int64_t d = 1; d < W; ++d) cursor[d] = cursor[d - 1] + send_counts[d - 1];
  std::vector<uint8_t> send(ex.num_rows() * rec);
  for (int64_t row = 0; row < ex.num_rows(); ++row) {
    uint8_t* p = &send[cursor[home * L + sh.local_of(ex.row_src_rank[row])]++ * rec];
    std::memcpy(p, &ex.row_src_rank[row], sizeof(int64_t));
    std::memcpy(p + sizeof(int64_t), &ex.row_combine_slot[row], sizeof(int64_t));
    std::memcpy(p + 2 * sizeof(int64_t), &y[row * H], H * sizeof(S));
  }
  const std::vector<uint8_t> in = cpu::exchange_by_rank(send, send_counts, recv_counts, rec, tr);

  // The relay: each arrived row under its relayed token's k. Relayed rows are grouped by
  // source node, each group in token order.
  const int64_t R = nodes.num_relayed(), rb = r.record_bytes;
  const int64_t token_offset = r.extra_offset - (1 + K) * int64_t(sizeof(int64_t));
  std::vector<int64_t> token(R);
  for (int64_t i = 0; i < R; ++i) std::memcpy(&token[i], &r.relayed[i * rb + token_offset], 8);
  std::vector<const uint8_t*> y_of(R * K, nullptr);
  for (size_t off = 0; off < in.size(); off += rec) {
    int64_t source, slot;
    std::memcpy(&source, &in[off], sizeof source);
    std::memcpy(&slot, &in[off + sizeof(int64_t)], sizeof slot);
    UNIEP_CHECK_CODE(source >= 0 && source < W && sh.local_of(source) == local && slot >= 0,
                     StatusCode::kInternal, "node_partials relay on rank ", me, ": a row for rank ",
                     source, " slot ", slot, " is not this relay's");
    const int64_t m = sh.node_of(source), t = slot / K, k = slot % K;
    const auto first = token.begin() + nodes.relay_offsets[m];
    const auto last = token.begin() + nodes.relay_offsets[m + 1];
    const auto it = std::lower_bound(first, last, t);
    UNIEP_CHECK_CODE(it != last && *it == t, StatusCode::kInternal, "node_partials relay on rank ",
                     me, ": rank ", source, " token ", t, " was never relayed here");
    const int64_t i = it - token.begin();
    UNIEP_CHECK_CODE(y_of[i * K + k] == nullptr, StatusCode::kInternal,
                     "node_partials relay on rank ", me, ": rank ", source, " token ", t,
                     " choice ", k, " arrived twice");
    y_of[i * K + k] = &in[off + 2 * sizeof(int64_t)];
  }

  // Leg 2 (rail): one partial per relayed token, back to its source.
  const int64_t part_bytes = cpu::align8(H * sizeof(S));
  std::vector<uint8_t> parts(R * part_bytes);
  std::vector<Acc> acc(H);
  for (int64_t i = 0; i < R; ++i) {
    const uint8_t* record = &r.relayed[i * rb];
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t k = 0; k < K; ++k) {
      int64_t e;
      std::memcpy(&e, record + token_offset + (1 + k) * sizeof(int64_t), sizeof e);
      const bool here = e >= 0 && sh.node_of(sh.rank_of_expert(e)) == home;
      UNIEP_CHECK_CODE(here == (y_of[i * K + k] != nullptr), StatusCode::kInternal,
                       "node_partials relay on rank ", me, ": token ", token[i], " choice ", k,
                       " (expert ", e, here ? ") got no result back" : ") got a stray result");
      if (!here) continue;
      Acc wk;
      std::memcpy(&wk, record + r.extra_offset + k * sizeof(Acc), sizeof(Acc));
      const S* yk = reinterpret_cast<const S*>(y_of[i * K + k]);
      for (int64_t c = 0; c < H; ++c) acc[c] += wk * St::load(yk[c]);
    }
    S* part = reinterpret_cast<S*>(&parts[i * part_bytes]);
    for (int64_t c = 0; c < H; ++c) part[c] = St::store(acc[c]);
  }
  std::vector<int64_t> send2(W, 0), recv2(W, 0);
  for (int64_t m = 0; m < N; ++m) {
    const int64_t peer = nodes.relay_source(m, me);
    send2[peer] = nodes.relay_offsets[m + 1] - nodes.relay_offsets[m];
    recv2[peer] = nodes.send_offsets[m + 1] - nodes.send_offsets[m];
  }
  const std::vector<uint8_t> back = cpu::exchange_by_rank(parts, send2, recv2, part_bytes, tr);

  // Home: the partials arrive grouped by node ascending, each node's in this rank's token order.
  std::vector<Acc> sum(T * H, Acc(0));
  for (int64_t i = 0; i < nodes.num_send(); ++i) {
    const S* part = reinterpret_cast<const S*>(&back[i * part_bytes]);
    Acc* dst = &sum[nodes.send_tokens[i] * H];
    for (int64_t c = 0; c < H; ++c) dst[c] += St::load(part[c]);
  }
  S* out = static_cast<S*>(a.out);
  for (int64_t i = 0; i < T * H; ++i) out[i] = St::store(sum[i]);
}

template <typename S>
void forward_impl(const MoeForwardArgs& a, Transport& tr) {
  using St = Storage<S>;
  using Acc = typename St::Acc;
  const MoeShape& sh = a.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.ffn_hidden, K = sh.top_k;
  // With rank or node partials the expert side or the relay applies the routing weights: they
  // travel with the token.
  const bool partials = a.tuning.combine != CombineReduction::kPerChoice;
  const bool fp8 = a.tuning.fp8_experts();
  Received<S> r = dispatch<S>(
      a, Pass::kForward, partials ? cpu::align8(K * int64_t(sizeof(Acc))) : 0,
      [&](int64_t t, uint8_t* p) {
        for (int64_t k = 0; k < K; ++k) {
          const Acc wk = load_weight<Acc>(a, t * K + k);
          std::memcpy(p + k * sizeof(Acc), &wk, sizeof(Acc));
        }
      },
      tr, /*decode_rows=*/!fp8);

  ExpertWeights<S> w(static_cast<const S*>(a.w1), static_cast<const S*>(a.w2),
                     sh.experts_per_rank(), H, I, a.w1_strides, a.w2_strides);
  if (fp8) w.round_to_fp8_blocks();
  const bool rank_partials = a.tuning.combine == CombineReduction::kRankPartials;
  const int64_t rows = r.experts.num_rows();
  std::vector<S> y(rank_partials ? 0 : rows * H);
  std::vector<Acc> y_acc(rank_partials ? rows * H : 0);  // unrounded, for rank partials
  cpu::RowForward<S> f(H, I, fp8, /*round_y=*/!rank_partials);
  for (const WorkTile& tile : r.tiles) {
    for (int64_t row = tile.row_begin; row < tile.row_end; ++row) {
      const int64_t slot = r.experts.row_slot[row];
      const int64_t tn = a.tuning.tile_n_or_default(), tk = a.tuning.tile_k_or_default();
      if (fp8) {
        cpu::decode_fp8_row(&r.raw[slot * r.record_bytes], H, f.x.data());
        f.run_loaded(w, tile.expert, tn, tk);
      } else {
        f.run(&r.x[slot * H], w, tile.expert, tn, tk);
      }
      if (rank_partials)
        std::copy(f.y.begin(), f.y.end(), y_acc.begin() + row * H);
      else
        for (int64_t n = 0; n < H; ++n) y[row * H + n] = St::store(f.y[n]);
    }
  }
  if (rank_partials) return combine_rank_partials<S>(a, r, y_acc, r.extra_offset, tr);
  if (a.tuning.combine == CombineReduction::kNodePartials)
    return combine_node_partials<S>(a, r, y, tr);

  std::vector<S> ybuf(T * K * H);
  combine(
      a, r, cpu::align8(H * sizeof(S)),
      [&](int64_t row, uint8_t* p) { std::memcpy(p, &y[row * H], H * sizeof(S)); },
      [&](int64_t slot, const uint8_t* p) { std::memcpy(&ybuf[slot * H], p, H * sizeof(S)); }, tr);

  S* out = static_cast<S*>(a.out);
  std::vector<Acc> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t k = 0; k < K; ++k) {
      if (a.topk_idx[t * K + k] < 0) continue;
      const Acc wk = load_weight<Acc>(a, t * K + k);
      const S* yk = &ybuf[(t * K + k) * H];
      for (int64_t n = 0; n < H; ++n) acc[n] += wk * St::load(yk[n]);
    }
    for (int64_t n = 0; n < H; ++n) out[t * H + n] = St::store(acc[n]);
  }
}

template <typename S>
void backward_impl(const MoeBackwardArgs& b, Transport& tr) {
  using St = Storage<S>;
  using Acc = typename St::Acc;
  const MoeForwardArgs& a = b.fwd;
  const MoeShape& sh = a.shape;
  const int64_t T = sh.tokens, H = sh.hidden, I = sh.ffn_hidden, K = sh.top_k;
  const int64_t El = sh.experts_per_rank();
  const S* grad_out = static_cast<const S*>(b.grad_out);

  // grad_out and the routing weights travel with the token: the expert side needs both.
  const int64_t go_bytes = cpu::align8(H * sizeof(S));
  Received<S> r = dispatch<S>(
      a, Pass::kBackward, cpu::align8(go_bytes + K * int64_t(sizeof(Acc))),
      [&](int64_t t, uint8_t* p) {
        std::memcpy(p, grad_out + t * H, H * sizeof(S));
        for (int64_t k = 0; k < K; ++k) {
          const Acc wk = load_weight<Acc>(a, t * K + k);
          std::memcpy(p + go_bytes + k * sizeof(Acc), &wk, sizeof(Acc));
        }
      },
      tr);

  const ExpertWeights<S> w(static_cast<const S*>(a.w1), static_cast<const S*>(a.w2), El, H, I,
                           a.w1_strides, a.w2_strides);
  const int64_t R = r.experts.num_rows();
  std::vector<Acc> act(R * I), gy(R * H), gh(R * 2 * I), dot(R);
  std::vector<S> gx(R * H);
  std::vector<Acc> go(H), ga(I), gxa(H);
  cpu::RowForward<S> f(H, I);
  for (const WorkTile& tile : r.tiles) {
    const Acc* w2e = w.down(tile.expert);
    const Acc* w1e = w.up(tile.expert);
    for (int64_t row = tile.row_begin; row < tile.row_end; ++row) {
      const int64_t slot = r.experts.row_slot[row];
      const int64_t k = r.experts.row_combine_slot[row] % K;
      f.run(&r.x[slot * H], w, tile.expert, a.tuning.tile_n_or_default(),
            a.tuning.tile_k_or_default());
      const uint8_t* extra = &r.raw[slot * r.record_bytes + r.extra_offset];
      Acc wk;
      std::memcpy(&wk, extra + go_bytes + k * sizeof(Acc), sizeof(Acc));
      const S* gos = reinterpret_cast<const S*>(extra);
      Acc d = Acc(0);
      for (int64_t n = 0; n < H; ++n) {
        S v;
        std::memcpy(&v, gos + n, sizeof(S));
        go[n] = St::load(v);
        d += go[n] * f.y[n];
        gy[row * H + n] = wk * go[n];
      }
      dot[row] = d;
      std::copy(f.act.begin(), f.act.end(), &act[row * I]);
      vec_mat_t(&gy[row * H], w2e, I, H, ga.data());
      Acc* ghr = &gh[row * 2 * I];
      for (int64_t i = 0; i < I; ++i) {
        const Acc g = f.h[i], u = f.h[I + i], s = cpu::sigmoid(g);
        ghr[i] = ga[i] * u * (s * (Acc(1) + g * (Acc(1) - s)));
        ghr[I + i] = ga[i] * (g * s);
      }
      vec_mat_t(ghr, w1e, H, 2 * I, gxa.data());
      for (int64_t n = 0; n < H; ++n) gx[row * H + n] = St::store(gxa[n]);
    }
  }

  // Weight gradients sum rows in row order, not tile order, so the schedule never changes them.
  S* gw1 = static_cast<S*>(b.grad_w1);
  S* gw2 = static_cast<S*>(b.grad_w2);
  std::vector<Acc> a1(H * 2 * I), a2(I * H), xa(H);
  for (int64_t e = 0; e < El; ++e) {
    std::fill(a1.begin(), a1.end(), Acc(0));
    std::fill(a2.begin(), a2.end(), Acc(0));
    for (int64_t row = r.experts.row_offsets[e]; row < r.experts.row_offsets[e + 1]; ++row) {
      const S* xs = &r.x[r.experts.row_slot[row] * H];
      for (int64_t n = 0; n < H; ++n) xa[n] = St::load(xs[n]);
      for (int64_t i = 0; i < I; ++i) {
        const Acc av = act[row * I + i];
        Acc* dst = &a2[i * H];
        for (int64_t n = 0; n < H; ++n) dst[n] += av * gy[row * H + n];
      }
      const Acc* ghr = &gh[row * 2 * I];
      for (int64_t n = 0; n < H; ++n) {
        const Acc xv = xa[n];
        Acc* dst = &a1[n * 2 * I];
        for (int64_t j = 0; j < 2 * I; ++j) dst[j] += xv * ghr[j];
      }
    }
    for (int64_t i = 0; i < H * 2 * I; ++i) gw1[e * H * 2 * I + i] = St::store(a1[i]);
    for (int64_t i = 0; i < I * H; ++i) gw2[e * I * H + i] = St::store(a2[i]);
  }

  const int64_t gx_bytes = cpu::align8(H * sizeof(S));
  std::vector<S> gxbuf(T * K * H);
  std::vector<Acc> dots(T * K, Acc(0));
  combine(
      a, r, cpu::align8(gx_bytes + int64_t(sizeof(Acc))),
      [&](int64_t row, uint8_t* p) {
        std::memcpy(p, &gx[row * H], H * sizeof(S));
        std::memcpy(p + gx_bytes, &dot[row], sizeof(Acc));
      },
      [&](int64_t slot, const uint8_t* p) {
        std::memcpy(&gxbuf[slot * H], p, H * sizeof(S));
        std::memcpy(&dots[slot], p + gx_bytes, sizeof(Acc));
      },
      tr);

  S* grad_x = static_cast<S*>(b.grad_x);
  std::vector<Acc> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), Acc(0));
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = t * K + k;
      store_weight(a, b.grad_topk_weights, i, a.topk_idx[i] < 0 ? 0.0 : double(dots[i]));
      if (a.topk_idx[i] < 0) continue;
      for (int64_t n = 0; n < H; ++n) acc[n] += St::load(gxbuf[i * H + n]);
    }
    for (int64_t n = 0; n < H; ++n) grad_x[t * H + n] = St::store(acc[n]);
  }
}

void check_args(const MoeForwardArgs& a) {
  a.shape.validate();
  a.tuning.validate();
  // dtype_size is 0 for a value outside the enum.
  UNIEP_CHECK(dtype_size(a.dtype) > 0, "dtype must be float32, bfloat16 or float64, got value ",
              static_cast<int64_t>(a.dtype));
  UNIEP_CHECK(dtype_size(a.weight_dtype) > 0,
              "weight_dtype must be float32, bfloat16 or float64, got value ",
              static_cast<int64_t>(a.weight_dtype));
  UNIEP_CHECK(a.weight_dtype != DType::kFloat64 || a.dtype == DType::kFloat64,
              "topk_weights must be float32 or bfloat16 (float64 only with float64 x), got ",
              dtype_name(a.weight_dtype), " with x ", dtype_name(a.dtype));
  // topk_idx is checked with the routing (compute_layout); the experts' pointers are read only
  // where this rank holds experts, the tokens' only where it has tokens.
  const bool tokens = a.shape.tokens > 0;
  UNIEP_CHECK(!tokens || a.x != nullptr, "x must not be null with tokens = ", a.shape.tokens);
  UNIEP_CHECK(!tokens || a.topk_weights != nullptr,
              "topk_weights must not be null with tokens = ", a.shape.tokens);
  UNIEP_CHECK(a.w1 != nullptr && a.w2 != nullptr, "w1 and w2 must not be null");
}

// The argument checks, shared with the peers when they fail (a bad argument on one rank must not
// leave the others waiting in the plan's exchange).
template <typename Checks>
void checked(const MoeForwardArgs& a, Pass pass, Transport& transport, Checks checks) {
  try {
    checks();
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument || transport.world_size() == 1) throw;
    cpu::fail_plan_agreement(e, static_cast<int64_t>(header_of(a, pass).size()), transport);
  }
}

}  // namespace

void cpu_moe_forward(const MoeForwardArgs& args, Transport& transport) {
  checked(args, Pass::kForward, transport, [&] {
    check_args(args);
    check_expert_precision(args.tuning, args.shape.hidden, args.shape.ffn_hidden);
    UNIEP_CHECK(args.shape.tokens == 0 || args.out != nullptr,
                "out must not be null with tokens = ", args.shape.tokens);
  });
  switch (args.dtype) {
    case DType::kFloat32:
      return forward_impl<float>(args, transport);
    case DType::kFloat64:
      return forward_impl<double>(args, transport);
    case DType::kBFloat16:
      return forward_impl<Bf16>(args, transport);
  }
}

void cpu_moe_backward(const MoeBackwardArgs& args, Transport& transport) {
  checked(args.fwd, Pass::kBackward, transport, [&] {
    check_args(args.fwd);
    const bool tokens = args.fwd.shape.tokens > 0;
    UNIEP_CHECK(!tokens || (args.grad_out != nullptr && args.grad_x != nullptr &&
                            args.grad_topk_weights != nullptr),
                "grad_out, grad_x and grad_topk_weights must not be null with tokens = ",
                args.fwd.shape.tokens);
    UNIEP_CHECK(args.grad_w1 != nullptr && args.grad_w2 != nullptr,
                "grad_w1 and grad_w2 must not be null");
  });
  switch (args.fwd.dtype) {
    case DType::kFloat32:
      return backward_impl<float>(args, transport);
    case DType::kFloat64:
      return backward_impl<double>(args, transport);
    case DType::kBFloat16:
      return backward_impl<Bf16>(args, transport);
  }
}

}  // namespace uniep
