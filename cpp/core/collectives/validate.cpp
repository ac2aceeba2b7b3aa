// validate_schedules: runs the schedules of all ranks symbolically, step by step in lockstep,
// tracking what each rank holds and, for the reductions, which ranks' contributions each
// accumulator carries. Every property a CUDA executor relies on is checked here, on the CPU.
#include <algorithm>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include "uniep/collectives.hpp"
#include "uniep/status.hpp"

namespace uniep {
namespace {

constexpr int64_t kNever = std::numeric_limits<int64_t>::max();

// (step, from, to, chunk): one message.
using Message = std::tuple<int64_t, int64_t, int64_t, int64_t>;

struct Context {
  const CollectiveSchedule& s0;
  template <typename... Args>
  void check(bool cond, int64_t rank, int64_t step, const Args&... args) const {
    UNIEP_CHECK_CODE(cond, StatusCode::kInternal, collective_kind_name(s0.kind), " schedule (",
                     peer_order_name(s0.order), ", W=", s0.world_size,
                     ", chunks=", s0.chunks_per_rank, "): rank ", rank, " step ", step, ": ",
                     args...);
  }
};

void check_shape(const Context& cx, const std::vector<CollectiveSchedule>& ranks) {
  const CollectiveSchedule& s0 = cx.s0;
  const int64_t W = s0.world_size, n = s0.num_chunks();
  UNIEP_CHECK_CODE(static_cast<int64_t>(ranks.size()) == W, StatusCode::kInternal,
                   "validate_schedules needs one schedule per rank: world size ", W, ", got ",
                   ranks.size());
  for (int64_t r = 0; r < W; ++r) {
    const CollectiveSchedule& s = ranks[r];
    cx.check(s.kind == s0.kind && s.order == s0.order && s.world_size == W &&
                 s.chunks_per_rank == s0.chunks_per_rank && s.rank == r,
             r, -1, "kind, order, world size, chunks or rank differ from rank 0's");
    cx.check(s.steps.size() == s0.steps.size(), r, -1, "has ", s.steps.size(),
             " steps, rank 0 has ", s0.steps.size());
    for (size_t t = 0; t < s.steps.size(); ++t) {
      const ChunkStep& st = s.steps[t];
      cx.check(st.has_transfers() == s0.steps[t].has_transfers(), r, t,
               "not lockstep: transfers here but not on rank 0, or the reverse");
      cx.check(st.compute >= -1 && st.compute < n, r, t, "compute chunk ", st.compute,
               " out of range");
      for (const auto* list : {&st.sends, &st.recvs, &st.input_waits, &st.fold_waits}) {
        for (const Transfer& x : *list) {
          cx.check(x.peer >= 0 && x.peer < W && x.peer != r, r, t, "bad peer ", x.peer,
                   " for chunk ", x.chunk);
          cx.check(x.chunk >= 0 && x.chunk < n, r, t, "chunk ", x.chunk, " out of range");
        }
      }
      if (s0.order == PeerOrder::kRing) {
        for (const Transfer& x : st.sends)
          cx.check(x.peer == (r + 1) % W, r, t, "ring sends chunk ", x.chunk, " to ", x.peer,
                   ", not to its neighbour ", (r + 1) % W);
        for (const Transfer& x : st.recvs)
          cx.check(x.peer == (r + W - 1) % W, r, t, "ring receives chunk ", x.chunk, " from ",
                   x.peer, ", not from its neighbour ", (r + W - 1) % W);
      }
    }
  }
}

void check_matching(const Context& cx, const std::vector<CollectiveSchedule>& ranks) {
  std::vector<Message> sent, received;
  for (const CollectiveSchedule& s : ranks) {
    for (size_t t = 0; t < s.steps.size(); ++t) {
      for (const Transfer& x : s.steps[t].sends) sent.emplace_back(t, s.rank, x.peer, x.chunk);
      for (const Transfer& x : s.steps[t].recvs) received.emplace_back(t, x.peer, s.rank, x.chunk);
    }
  }
  std::sort(sent.begin(), sent.end());
  std::sort(received.begin(), received.end());
  for (const auto* list : {&sent, &received}) {
    const auto dup = std::adjacent_find(list->begin(), list->end());
    if (dup != list->end()) {
      cx.check(false, std::get<1>(*dup), std::get<0>(*dup), "chunk ", std::get<3>(*dup),
               " goes to rank ", std::get<2>(*dup), " twice in one step");
    }
  }
  std::vector<Message> unmatched;
  std::set_symmetric_difference(sent.begin(), sent.end(), received.begin(), received.end(),
                                std::back_inserter(unmatched));
  if (!unmatched.empty()) {
    const Message& m = unmatched.front();
    const bool is_send = std::binary_search(sent.begin(), sent.end(), m);
    cx.check(false, is_send ? std::get<1>(m) : std::get<2>(m), std::get<0>(m),
             is_send ? "send of chunk " : "receive of chunk ", std::get<3>(m),
             is_send ? " to rank " : " from rank ", is_send ? std::get<2>(m) : std::get<1>(m),
             " has no matching ", is_send ? "receive" : "send", " in the same step");
  }
}

// AG-GEMM, all-gather, all-to-all: chunks are data that is held from the step after it arrives.
void check_gather(const Context& cx, const std::vector<CollectiveSchedule>& ranks) {
  const CollectiveSchedule& s0 = cx.s0;
  const int64_t W = s0.world_size, n = s0.num_chunks(), T = s0.steps.size();
  const bool a2a = s0.kind == CollectiveKind::kAllToAllUlysses;
  const bool computes = s0.kind != CollectiveKind::kAllGather;
  for (const CollectiveSchedule& s : ranks) {
    const int64_t r = s.rank;
    auto own = [&](int64_t x) { return a2a ? s.chunk_src(x) == r : s.chunk_block(x) == r; };
    auto needed = [&](int64_t x) { return a2a ? s.chunk_dst(x) == r : true; };
    std::vector<int64_t> held(n, kNever), from(n, -1), consumed(n, 0), computed(n, 0);
    for (int64_t x = 0; x < n; ++x)
      if (own(x)) held[x] = 0;
    for (int64_t t = 0; t < T; ++t) {
      const ChunkStep& st = s.steps[t];
      for (const Transfer& x : st.sends) {
        cx.check(held[x.chunk] <= t, r, t, "sends chunk ", x.chunk, " it does not hold yet");
        cx.check(!a2a || s.chunk_dst(x.chunk) != r, r, t, "sends on chunk ", x.chunk,
                 ", which is addressed to itself");
        if (!own(x.chunk)) consumed[x.chunk] = 1;
      }
      if (st.compute >= 0) {
        const int64_t x = st.compute;
        cx.check(computes, r, t, "computes chunk ", x, " in a plain all-gather");
        cx.check(needed(x), r, t, "computes chunk ", x, ", which is addressed to another rank");
        cx.check(computed[x]++ == 0, r, t, "computes chunk ", x, " a second time");
        cx.check(held[x] <= t, r, t, "computes chunk ", x,
                 " before it arrived (a GEMM may only read transfers of earlier steps)");
        if (own(x)) {
          cx.check(st.input_waits.empty(), r, t, "waits on a signal for its local chunk ", x);
        } else {
          cx.check(st.input_waits.size() == 1 && st.input_waits[0] == Transfer{from[x], x}, r, t,
                   "input_waits must be exactly the arrival of chunk ", x, " from rank ", from[x]);
          consumed[x] = 1;
        }
      } else {
        cx.check(st.input_waits.empty(), r, t, "input_waits without a compute");
      }
      cx.check(st.fold_waits.empty(), r, t, "fold_waits in a gather schedule");
      for (const Transfer& x : st.recvs) {
        cx.check(!own(x.chunk), r, t, "receives its own chunk ", x.chunk);
        cx.check(held[x.chunk] == kNever, r, t, "receives chunk ", x.chunk, " a second time");
        held[x.chunk] = t + 1;
        from[x.chunk] = x.peer;
      }
    }
    for (int64_t x = 0; x < n; ++x) {
      if (!needed(x)) continue;
      cx.check(held[x] != kNever, r, T, "never receives chunk ", x);
      if (computes) cx.check(computed[x] == 1, r, T, "never computes chunk ", x);
    }
    if (!computes) continue;
    // Tail-free: one compute per step, the first on local data, and every arrival consumed (by a
    // compute that waits on it, or a forward) at a later step, with the last step issuing
    // nothing: once the last GEMM starts, nothing is in flight.
    cx.check(T == n / (a2a ? W : 1), r, T, "has ", T, " steps for ", n / (a2a ? W : 1),
             " computes: a step without a GEMM leaves its transfers exposed");
    cx.check(T == 0 || s.steps[0].input_waits.empty(), r, 0,
             "the first GEMM must be on a local chunk");
    cx.check(T == 0 || !s.steps[T - 1].has_transfers(), r, T - 1,
             "the last step issues transfers: they would be outstanding after the last GEMM");
    for (int64_t x = 0; x < n; ++x) {
      cx.check(own(x) || held[x] == kNever || consumed[x], r, T, "receives chunk ", x,
               " but never uses it");
    }
  }
}

// GEMM-RS, reduce-scatter: results are accumulators, each a list of contributing ranks.
void check_reduce(const Context& cx, const std::vector<CollectiveSchedule>& ranks) {
  const CollectiveSchedule& s0 = cx.s0;
  const int64_t W = s0.world_size, n = s0.num_chunks(), T = s0.steps.size();
  const bool ring = s0.order == PeerOrder::kRing;
  std::vector<std::vector<std::vector<int64_t>>> result(W, std::vector<std::vector<int64_t>>(n));
  std::vector<std::vector<int64_t>> ready(W, std::vector<int64_t>(n, kNever));
  struct Arrival {
    int64_t step;
    std::vector<int64_t> contents;
    bool folded = false;
  };
  // Arrivals on each rank, keyed by (from, chunk): a chunk comes from one peer once.
  std::vector<std::map<std::pair<int64_t, int64_t>, Arrival>> arrived(W);
  for (int64_t t = 0; t < T; ++t) {
    std::map<Message, std::vector<int64_t>> payload;
    for (const CollectiveSchedule& s : ranks) {
      const int64_t r = s.rank;
      for (const Transfer& x : s.steps[t].sends) {
        cx.check(ready[r][x.chunk] <= t, r, t, "sends chunk ", x.chunk,
                 " before computing it (results leave one step after their GEMM at the earliest)");
        cx.check(s.chunk_block(x.chunk) != r, r, t, "sends its own rows' chunk ", x.chunk);
        if (!ring) {
          cx.check(x.peer == s.chunk_block(x.chunk), r, t, "direct send of chunk ", x.chunk,
                   " to rank ", x.peer, " instead of its destination");
          cx.check(result[r][x.chunk].size() == 1, r, t, "direct send of chunk ", x.chunk,
                   " carries an accumulator, not this rank's partial");
        }
        payload[{t, r, x.peer, x.chunk}] = result[r][x.chunk];
      }
    }
    for (const CollectiveSchedule& s : ranks) {
      const int64_t r = s.rank;
      for (const Transfer& x : s.steps[t].recvs) {
        const bool fresh = arrived[r].count({x.peer, x.chunk}) == 0;
        cx.check(fresh, r, t, "receives chunk ", x.chunk, " from rank ", x.peer, " twice");
        arrived[r][{x.peer, x.chunk}] = {t, payload[{t, x.peer, r, x.chunk}]};
      }
    }
    for (const CollectiveSchedule& s : ranks) {
      const int64_t r = s.rank;
      const ChunkStep& st = s.steps[t];
      cx.check(st.compute >= 0, r, t, "no compute: this step's transfers would be exposed");
      cx.check(st.input_waits.empty(), r, t, "input_waits in a reduce schedule");
      const int64_t u = st.compute;
      cx.check(ready[r][u] == kNever, r, t, "computes chunk ", u, " a second time");
      std::vector<int64_t> contents;
      for (const Transfer& w : st.fold_waits) {
        cx.check(w.chunk == u, r, t, "folds chunk ", w.chunk, " into chunk ", u);
        auto it = arrived[r].find({w.peer, w.chunk});
        cx.check(it != arrived[r].end() && it->second.step <= t, r, t, "folds chunk ", u,
                 " from rank ", w.peer, " before a transfer of it was issued");
        cx.check(!it->second.folded, r, t, "folds chunk ", u, " from rank ", w.peer, " twice");
        it->second.folded = true;
        contents.insert(contents.end(), it->second.contents.begin(), it->second.contents.end());
      }
      contents.push_back(r);
      result[r][u] = contents;
      ready[r][u] = t + 1;
    }
  }
  for (const CollectiveSchedule& s : ranks) {
    const int64_t r = s.rank;
    for (const auto& [key, a] : arrived[r])
      cx.check(a.folded, r, T, "never folds chunk ", key.second, " from rank ", key.first);
    for (int64_t u = 0; u < n; ++u) {
      cx.check(ready[r][u] != kNever, r, T, "never computes chunk ", u);
      if (s.chunk_block(u) != r) continue;
      const std::vector<int64_t> want = reduce_order(W, r);
      std::string got;
      for (int64_t q : result[r][u]) got += std::to_string(q) + " ";
      cx.check(result[r][u] == want, r, T, "chunk ", u, " sums the contributions of ranks [ ", got,
               "], not reduce_order(", W, ", ", r, ")");
    }
    // Tail-free: every step computes, the last one on the rank's own rows, so the last GEMM's
    // output needs no transfer; folds happen no later than the last step (checked above).
    cx.check(T == n, r, T, "has ", T, " steps for ", n, " GEMM chunks");
    cx.check(T == 0 || s.chunk_block(s.steps[T - 1].compute) == r, r, T - 1,
             "the last GEMM is not on the rank's own rows: its output would need a transfer "
             "after it");
  }
}

}  // namespace

void validate_schedules(const std::vector<CollectiveSchedule>& ranks) {
  UNIEP_CHECK_CODE(!ranks.empty(), StatusCode::kInternal, "validate_schedules: no schedules");
  const Context cx{ranks[0]};
  check_shape(cx, ranks);
  check_matching(cx, ranks);
  if (is_reduce_kind(cx.s0.kind)) {
    check_reduce(cx, ranks);
  } else {
    check_gather(cx, ranks);
  }
}

}  // namespace uniep
