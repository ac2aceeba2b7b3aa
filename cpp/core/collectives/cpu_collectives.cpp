// The CPU executor of the collective schedules: every step exchanges its chunks through the
// PeerTransport, then computes its chunk with plain loops. On the CPU a step's transfers complete
// before its compute, which is the ordering the plan already allows; the executor still checks
// that each compute only reads what the plan says has arrived, so it tests the plan too.
#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/cpu_math.hpp"
#include "core/numeric.hpp"
#include "uniep/collectives.hpp"
#include "uniep/status.hpp"

namespace uniep {
namespace {

using numeric::Bf16;
using numeric::Storage;

// What every rank must agree on before the first transfer. rows/width are kind-specific (named
// in the messages); shape and the all-to-all dims pin down the layout that equal byte counts
// alone do not (a [2, 4, 6] and a [2, 6, 4] tensor move the same bytes).
struct CallHeader {
  CollectiveKind kind;
  PeerOrder order;
  int64_t chunks;
  DType dtype;
  int64_t rows;
  int64_t width;
  std::vector<int64_t> shape;  // x.shape; empty: not agreed on (the matmul kinds)
  int64_t scatter_dim = 0;     // all-to-all only
  int64_t gather_dim = 0;
};
// The header's words on the wire, then the first kInlineDims of the shape (zero-padded); a longer
// shape takes a second exchange.
enum Word : int64_t {
  kKind,
  kOrder,
  kChunks,
  kDtype,
  kRows,
  kWidth,
  kScatterDim,
  kGatherDim,
  kVerdict,  // 1: this rank's arguments passed its own checks
  kNdim,
  kFixedWords
};
constexpr int64_t kInlineDims = 8, kHeaderWords = kFixedWords + kInlineDims;

const char* rows_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGatherMatmul:
      return "rows per rank (a.size(0))";
    case CollectiveKind::kAllGather:
      return "rows per rank (x.size(0))";
    case CollectiveKind::kMatmulReduceScatter:
      return "rows per rank (a.size(0) / world size)";
    case CollectiveKind::kReduceScatter:
      return "rows per rank (x.size(0) / world size)";
    case CollectiveKind::kAllToAllUlysses:
      return "block bytes";
  }
  return "rows";
}

const char* width_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGatherMatmul:
      return "K (a.size(1))";
    case CollectiveKind::kMatmulReduceScatter:
      return "N (b.size(1))";
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
      return "elements per row";
    case CollectiveKind::kAllToAllUlysses:
      return "unused";
  }
  return "width";
}

std::string shape_str(const int64_t* dims, int64_t ndim) {
  std::string s = "[";
  for (int64_t d = 0; d < ndim; ++d) s += detail::str_cat(d ? ", " : "", dims[d]);
  return s + "]";
}

// Exchanges the header and this rank's verdict; throws on every rank if any rank failed or the
// headers differ. The local error is rethrown as is, so its message names the argument; a
// mismatch is reported as rank 0's value against the first rank that differs from it, so every
// rank raises the same message.
void agree(const CallHeader& h, const std::string& local_error, PeerTransport& tr) {
  const int64_t W = tr.world_size(), ndim = static_cast<int64_t>(h.shape.size());
  std::vector<int64_t> mine(kHeaderWords, 0);
  mine[kKind] = static_cast<int64_t>(h.kind);
  mine[kOrder] = static_cast<int64_t>(h.order);
  mine[kChunks] = h.chunks;
  mine[kDtype] = static_cast<int64_t>(h.dtype);
  mine[kRows] = h.rows;
  mine[kWidth] = h.width;
  mine[kScatterDim] = h.scatter_dim;
  mine[kGatherDim] = h.gather_dim;
  mine[kVerdict] = local_error.empty() ? 1 : 0;
  mine[kNdim] = ndim;
  std::copy_n(h.shape.begin(), std::min(ndim, kInlineDims), mine.begin() + kFixedWords);
  std::vector<int64_t> all(W * kHeaderWords);
  tr.all_gather(mine.data(), kHeaderWords, all.data());
  auto word = [&](int64_t r, Word w) { return all[r * kHeaderWords + w]; };
  // Every rank sees the same ndims, so either all of them take the second exchange or none does.
  int64_t max_ndim = 0;
  for (int64_t r = 0; r < W; ++r) max_ndim = std::max(max_ndim, word(r, kNdim));
  // [W][max_ndim], indexed through data(): with no shapes (max_ndim 0, the matmul kinds) it is
  // empty, and &shapes[i] would index an empty vector.
  std::vector<int64_t> shapes(W * max_ndim);
  if (max_ndim > kInlineDims) {
    std::vector<int64_t> padded(h.shape);
    padded.resize(max_ndim, 0);
    tr.all_gather(padded.data(), max_ndim, shapes.data());
  } else if (max_ndim > 0) {
    for (int64_t r = 0; r < W; ++r)
      std::copy_n(all.data() + r * kHeaderWords + kFixedWords, max_ndim,
                  shapes.data() + r * max_ndim);
  }
  auto shape_of = [&](int64_t r) {
    return max_ndim > 0 ? shape_str(shapes.data() + r * max_ndim, word(r, kNdim)) : "[]";
  };

  UNIEP_CHECK(local_error.empty(), local_error);
  const char* op = collective_kind_name(h.kind);
  for (int64_t r = 0; r < W; ++r) {
    UNIEP_CHECK(word(r, kKind) == mine[kKind], op, ": rank ", r, " called ",
                collective_kind_name(static_cast<CollectiveKind>(word(r, kKind))),
                " at the same time: every rank of the group must call the same collectives in "
                "the same order");
    UNIEP_CHECK(word(r, kVerdict) == 1, op, ": rank ", r,
                " passed invalid arguments (its error names the argument)");
  }
  auto differs = [&](const char* name, const std::string& first, int64_t r,
                     const std::string& theirs) {
    UNIEP_CHECK(false, op, ": ", name, " differs across ranks: rank 0 has ", first, ", rank ", r,
                " has ", theirs);
  };
  auto int_field = [&](Word w, const char* name, int64_t r) {
    if (word(r, w) != word(0, w))
      differs(name, std::to_string(word(0, w)), r, std::to_string(word(r, w)));
  };
  const bool a2a = h.kind == CollectiveKind::kAllToAllUlysses;
  // The fields in the order their messages help most: the layout before the byte counts
  // derived from it.
  for (int64_t r = 1; r < W; ++r) {
    if (word(r, kOrder) != word(0, kOrder))
      differs("order", peer_order_name(static_cast<PeerOrder>(word(0, kOrder))), r,
              peer_order_name(static_cast<PeerOrder>(word(r, kOrder))));
    int_field(kChunks, "chunks", r);
    if (word(r, kDtype) != word(0, kDtype))
      differs("dtype", dtype_name(static_cast<DType>(word(0, kDtype))), r,
              dtype_name(static_cast<DType>(word(r, kDtype))));
    if (a2a) {
      int_field(kScatterDim, "scatter_dim", r);
      int_field(kGatherDim, "gather_dim", r);
    }
    if (shape_of(r) != shape_of(0)) differs("x.shape", shape_of(0), r, shape_of(r));
    int_field(kRows, rows_name(h.kind), r);
    int_field(kWidth, width_name(h.kind), r);
  }
}

// Runs `check` (argument validation of this rank) and the agreement; a failed check still takes
// part in the agreement so that the peers fail too instead of waiting in a transfer.
template <typename Check>
void validate_and_agree(const CallHeader& h, PeerTransport& tr, Check check) {
  std::string local_error;
  try {
    check();
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    local_error = e.what();
  }
  agree(h, local_error, tr);
}

void check_transport(PeerTransport& tr) {
  UNIEP_CHECK_CODE(tr.world_size() >= 1 && tr.rank() >= 0 && tr.rank() < tr.world_size(),
                   StatusCode::kInternal, "transport has rank ", tr.rank(), " of ",
                   tr.world_size());
}

void check_rows(int64_t rows, int64_t chunks, const char* what) {
  UNIEP_CHECK(chunks >= 1, "chunks must be >= 1, got ", chunks);
  UNIEP_CHECK(rows >= 0, what, " must be >= 0, got ", rows);
  UNIEP_CHECK(rows % chunks == 0, "chunks (", chunks, ") must divide the ", what, " (", rows, ")");
}

// Arrival bookkeeping shared by the executors: the step at which each chunk landed here.
class Arrivals {
 public:
  static constexpr int64_t kNotYet = std::numeric_limits<int64_t>::max();
  explicit Arrivals(int64_t chunks) : step_(chunks, kNotYet) {}
  // step -1: held from the start (this rank's own data).
  void land(int64_t chunk, int64_t step) {
    UNIEP_CHECK_CODE(step_[chunk] == kNotYet, StatusCode::kInternal, "chunk ", chunk,
                     " arrived twice (step ", step, ")");
    step_[chunk] = step;
  }
  // Usable at step t if it landed in an earlier step.
  void require(int64_t chunk, int64_t t, const char* use) const {
    UNIEP_CHECK_CODE(step_[chunk] < t, StatusCode::kInternal, use, " chunk ", chunk, " at step ", t,
                     " before it arrived");
  }

 private:
  std::vector<int64_t> step_;
};

// out[n] = sum_k a[k] * b[k, n] for each row of a, k ascending, rounded to S once.
template <typename S>
class RowGemm {
 public:
  using St = Storage<S>;
  using Acc = typename St::Acc;

  RowGemm(const S* b, int64_t k, int64_t n) : k_(k), n_(n), b_(k * n), a_(k), c_(n) {
    for (int64_t i = 0; i < k * n; ++i) b_[i] = St::load(b[i]);
  }
  void row(const S* a, S* out) {
    for (int64_t i = 0; i < k_; ++i) a_[i] = St::load(a[i]);
    cpu::vec_mat(a_.data(), k_, b_.data(), n_, std::max<int64_t>(n_, 1), std::max<int64_t>(k_, 1),
                 c_.data());
    for (int64_t i = 0; i < n_; ++i) out[i] = St::store(c_[i]);
  }

 private:
  int64_t k_, n_;
  std::vector<Acc> b_, a_, c_;
};

template <typename S>
void gather_impl(CollectiveKind kind, const AllGatherArgs& a, const CollectiveSchedule& s,
                 PeerTransport& tr) {
  const int64_t r = s.rank, m = a.rows_per_rank, rc = m / a.chunks;
  const int64_t row_bytes = a.k * int64_t(sizeof(S)), chunk_bytes = rc * row_bytes;
  uint8_t* g = static_cast<uint8_t*>(a.gathered);
  auto at = [&](int64_t chunk) {
    return g + (s.chunk_block(chunk) * m + s.chunk_part(chunk) * rc) * row_bytes;
  };
  if (m * row_bytes > 0) std::memcpy(g + r * m * row_bytes, a.a, m * row_bytes);
  const bool gemm = kind == CollectiveKind::kAllGatherMatmul;
  RowGemm<S> mm(gemm ? static_cast<const S*>(a.b) : nullptr, gemm ? a.k : 0, gemm ? a.n : 0);
  Arrivals arrivals(s.num_chunks());
  for (int64_t x = 0; x < s.chunks_per_rank; ++x) arrivals.land(s.chunk_id(r, x), -1);
  for (int64_t t = 0; t < static_cast<int64_t>(s.steps.size()); ++t) {
    const ChunkStep& st = s.steps[t];
    // Empty chunks (m or K zero on every rank: agreed) need no messages.
    if (st.has_transfers() && chunk_bytes > 0) {
      std::vector<PeerSend> sends;
      std::vector<PeerRecv> recvs;
      for (const Transfer& x : st.sends) {
        arrivals.require(x.chunk, t, "sends");
        sends.push_back({x.peer, x.chunk, at(x.chunk), chunk_bytes});
      }
      for (const Transfer& x : st.recvs)
        recvs.push_back({x.peer, x.chunk, at(x.chunk), chunk_bytes});
      tr.exchange(sends, recvs);
    }
    for (const Transfer& x : st.recvs) arrivals.land(x.chunk, t);
    if (st.compute < 0) continue;
    arrivals.require(st.compute, t, "computes");
    const int64_t row0 = s.chunk_block(st.compute) * m + s.chunk_part(st.compute) * rc;
    const S* in = reinterpret_cast<const S*>(g) + row0 * a.k;
    S* out = static_cast<S*>(a.out) + row0 * a.n;
    for (int64_t i = 0; i < rc; ++i) mm.row(in + i * a.k, out + i * a.n);
  }
  for (int64_t x = 0; x < s.num_chunks(); ++x) arrivals.require(x, s.steps.size() + 1, "returns");
}

template <typename S>
void reduce_impl(CollectiveKind kind, const ReduceScatterArgs& a, const CollectiveSchedule& s,
                 PeerTransport& tr) {
  using St = Storage<S>;
  using Acc = typename St::Acc;
  const int64_t W = s.world_size, r = s.rank, c = s.chunks_per_rank;
  const int64_t m = a.rows_per_rank, rc = m / c, N = a.n, ce = rc * N;
  const bool ring = s.order == PeerOrder::kRing,
             gemm = kind == CollectiveKind::kMatmulReduceScatter;
  const S* in = static_cast<const S*>(a.a);
  RowGemm<S> mm(gemm ? static_cast<const S*>(a.b) : nullptr, gemm ? a.k : 0, gemm ? N : 0);
  const int64_t in_width = gemm ? a.k : N;

  // The partial of chunk u: rows of a @ b (or of the input) in storage type, as a GEMM writes it.
  std::vector<S> partial(ce);
  auto compute_partial = [&](int64_t u) {
    const int64_t row0 = s.chunk_block(u) * m + s.chunk_part(u) * rc;
    for (int64_t i = 0; i < rc; ++i) {
      const S* row = in + (row0 + i) * in_width;
      if (gemm) {
        mm.row(row, &partial[i * N]);
      } else {
        std::copy(row, row + N, &partial[i * N]);
      }
    }
  };
  // direct: partials waiting to be sent, and one receive slot per (source, part) of own rows.
  // ring: accumulators waiting to be sent, and the one arriving for each chunk.
  const int64_t n = s.num_chunks(), wire = ring ? int64_t(sizeof(Acc)) : int64_t(sizeof(S));
  std::vector<S> outgoing_partial(ring ? 0 : n * ce), slot(ring ? 0 : W * c * ce);
  std::vector<Acc> outgoing_acc(ring ? n * ce : 0), incoming_acc(ring ? n * ce : 0);
  auto send_ptr = [&](int64_t u) -> const void* {
    return ring ? static_cast<const void*>(&outgoing_acc[u * ce])
                : static_cast<const void*>(&outgoing_partial[u * ce]);
  };
  auto recv_ptr = [&](int64_t peer, int64_t u) -> void* {
    return ring ? static_cast<void*>(&incoming_acc[u * ce])
                : static_cast<void*>(&slot[(peer * c + s.chunk_part(u)) * ce]);
  };
  std::map<std::pair<int64_t, int64_t>, int64_t> landed;  // (peer, chunk) -> step
  std::vector<int64_t> done(n, -1);
  std::vector<Acc> acc(ce);
  for (int64_t t = 0; t < static_cast<int64_t>(s.steps.size()); ++t) {
    const ChunkStep& st = s.steps[t];
    if (st.has_transfers() && ce > 0) {
      std::vector<PeerSend> sends;
      std::vector<PeerRecv> recvs;
      for (const Transfer& x : st.sends) {
        UNIEP_CHECK_CODE(done[x.chunk] >= 0 && done[x.chunk] < t, StatusCode::kInternal,
                         "sends chunk ", x.chunk, " at step ", t, " before computing it");
        sends.push_back({x.peer, x.chunk, send_ptr(x.chunk), ce * wire});
      }
      for (const Transfer& x : st.recvs)
        recvs.push_back({x.peer, x.chunk, recv_ptr(x.peer, x.chunk), ce * wire});
      tr.exchange(sends, recvs);
    }
    for (const Transfer& x : st.recvs) landed[{x.peer, x.chunk}] = t;
    const int64_t u = st.compute;
    UNIEP_CHECK_CODE(u >= 0 && done[u] < 0, StatusCode::kInternal, "step ", t,
                     " of a reduce schedule computes chunk ", u);
    compute_partial(u);
    // acc = fold_0 + fold_1 + ... + partial, left to right: the same fp32 additions in the same
    // order whether the folds are partials from slots (direct) or one upstream accumulator (ring).
    for (size_t f = 0; f < st.fold_waits.size(); ++f) {
      const Transfer& w = st.fold_waits[f];
      auto it = landed.find({w.peer, w.chunk});
      UNIEP_CHECK_CODE(it != landed.end() && it->second <= t && w.chunk == u, StatusCode::kInternal,
                       "step ", t, " folds chunk ", w.chunk, " from rank ", w.peer,
                       " before it arrived");
      for (int64_t e = 0; e < ce; ++e) {
        const Acc v = ring ? incoming_acc[u * ce + e]
                           : St::load(slot[(w.peer * c + s.chunk_part(u)) * ce + e]);
        acc[e] = f == 0 ? v : acc[e] + v;
      }
    }
    for (int64_t e = 0; e < ce; ++e) {
      const Acc p = St::load(partial[e]);
      acc[e] = st.fold_waits.empty() ? p : acc[e] + p;
    }
    done[u] = t;
    if (s.chunk_block(u) == r) {
      S* out = static_cast<S*>(a.out) + s.chunk_part(u) * ce;
      for (int64_t e = 0; e < ce; ++e) out[e] = St::store(acc[e]);
    } else if (ring) {
      std::copy(acc.begin(), acc.end(), &outgoing_acc[u * ce]);
    } else {
      UNIEP_CHECK_CODE(st.fold_waits.empty(), StatusCode::kInternal,
                       "direct reduce folds into another rank's chunk ", u);
      std::copy(partial.begin(), partial.end(), &outgoing_partial[u * ce]);
    }
  }
}

template <typename Fn>
void by_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32:
      fn(float{});
      return;
    case DType::kBFloat16:
      fn(Bf16{});
      return;
    case DType::kFloat64:
      fn(double{});
      return;
  }
  UNIEP_CHECK(false, "unknown dtype");
}

}  // namespace

void LocalPeerTransport::all_gather(const int64_t* in, int64_t n, int64_t* out) {
  if (n > 0) std::memcpy(out, in, n * sizeof(int64_t));
}

void LocalPeerTransport::exchange(const std::vector<PeerSend>& sends,
                                  const std::vector<PeerRecv>& recvs) {
  UNIEP_CHECK_CODE(sends.empty() && recvs.empty(), StatusCode::kInternal,
                   "LocalPeerTransport: a world of one rank has no peers to exchange with");
}

void fail_collective_call(CollectiveKind kind, const Error& error, PeerTransport& transport) {
  agree({kind, PeerOrder::kDirect, 1, DType::kFloat32, 0, 0, {}}, error.what(), transport);
  throw error;  // agree() throws first when the error is kInvalidArgument
}

void cpu_all_gather(CollectiveKind kind, const AllGatherArgs& args, PeerTransport& transport) {
  check_transport(transport);
  validate_and_agree(
      {kind, args.order, args.chunks, args.dtype, args.rows_per_rank, args.k, args.shape},
      transport, [&] {
        UNIEP_CHECK(is_gather_kind(kind),
                    "cpu_all_gather: kind must be "
                    "all_gather_matmul or all_gather, got ",
                    collective_kind_name(kind));
        check_rows(args.rows_per_rank, args.chunks, "rows per rank");
        UNIEP_CHECK(args.k >= 0 && args.n >= 0, "k and n must be >= 0");
      });
  const CollectiveSchedule s =
      make_schedule(kind, transport.world_size(), transport.rank(), args.chunks, args.order);
  by_dtype(args.dtype, [&](auto tag) { gather_impl<decltype(tag)>(kind, args, s, transport); });
}

void cpu_reduce_scatter(CollectiveKind kind, const ReduceScatterArgs& args,
                        PeerTransport& transport) {
  check_transport(transport);
  validate_and_agree(
      {kind, args.order, args.chunks, args.dtype, args.rows_per_rank, args.n, args.shape},
      transport, [&] {
        UNIEP_CHECK(is_reduce_kind(kind),
                    "cpu_reduce_scatter: kind must be "
                    "matmul_reduce_scatter or reduce_scatter, got ",
                    collective_kind_name(kind));
        check_rows(args.rows_per_rank, args.chunks, "rows per rank");
        UNIEP_CHECK(args.k >= 0 && args.n >= 0, "k and n must be >= 0");
      });
  const CollectiveSchedule s =
      make_schedule(kind, transport.world_size(), transport.rank(), args.chunks, args.order);
  by_dtype(args.dtype, [&](auto tag) { reduce_impl<decltype(tag)>(kind, args, s, transport); });
}

void cpu_all_to_all(const AllToAllArgs& args, PeerTransport& transport) {
  check_transport(transport);
  const CollectiveKind kind = CollectiveKind::kAllToAllUlysses;
  validate_and_agree({kind, args.order, args.chunks, args.dtype, args.block_bytes, 0, args.shape,
                      args.scatter_dim, args.gather_dim},
                     transport, [&] { check_rows(args.block_bytes, args.chunks, "block bytes"); });
  const CollectiveSchedule s =
      make_schedule(kind, transport.world_size(), transport.rank(), args.chunks, args.order);
  const int64_t W = s.world_size, r = s.rank, B = args.block_bytes, pb = B / args.chunks;
  const uint8_t* send = static_cast<const uint8_t*>(args.send);
  uint8_t* recv = static_cast<uint8_t*>(args.recv);
  // Blocks addressed here land in place; blocks passing through (ring) wait in staging.
  std::map<int64_t, std::vector<uint8_t>> staging;
  auto where = [&](int64_t x) -> uint8_t* {
    const int64_t src = s.chunk_src(x), dst = s.chunk_dst(x), j = s.chunk_part(x);
    if (dst == r) return recv + src * B + j * pb;
    if (src == r) return const_cast<uint8_t*>(send) + dst * B + j * pb;  // only ever read
    std::vector<uint8_t>& buf = staging[x];
    buf.resize(pb);
    return buf.data();
  };
  Arrivals arrivals(s.num_chunks());
  for (int64_t d = 0; d < W; ++d)
    for (int64_t j = 0; j < args.chunks; ++j) arrivals.land(s.chunk_id(r * W + d, j), -1);
  for (int64_t t = 0; t < static_cast<int64_t>(s.steps.size()); ++t) {
    const ChunkStep& st = s.steps[t];
    if (st.has_transfers() && pb > 0) {
      std::vector<PeerSend> sends;
      std::vector<PeerRecv> recvs;
      for (const Transfer& x : st.sends) {
        arrivals.require(x.chunk, t, "sends");
        sends.push_back({x.peer, x.chunk, where(x.chunk), pb});
      }
      for (const Transfer& x : st.recvs) recvs.push_back({x.peer, x.chunk, where(x.chunk), pb});
      transport.exchange(sends, recvs);
    }
    for (const Transfer& x : st.recvs) arrivals.land(x.chunk, t);
    if (st.compute < 0) continue;
    arrivals.require(st.compute, t, "places");
    if (s.chunk_src(st.compute) == r && pb > 0) {
      const int64_t j = s.chunk_part(st.compute);
      std::memcpy(recv + r * B + j * pb, send + r * B + j * pb, pb);
    }
  }
}

}  // namespace uniep
