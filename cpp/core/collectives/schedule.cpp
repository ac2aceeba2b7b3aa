// The chunk schedules of the P2P-decomposed collectives. Pure functions of (kind, W, rank, c,
// order); include/uniep/collectives.hpp states the step model and why each order is tail-free.
#include <string>

#include "uniep/collectives.hpp"
#include "uniep/status.hpp"

namespace uniep {
namespace {

int64_t wrap(int64_t r, int64_t w) {
  return ((r % w) + w) % w;
}

// AG-GEMM, and with chunk ids per (src, dst) the all-to-all. Step i*c+j computes part j of the
// block from rank src_i (local first: src_0 = r); the transfer feeding step t+c is issued at step
// t, so the last c steps issue nothing.
void gather_steps(CollectiveSchedule& s) {
  const int64_t W = s.world_size, r = s.rank, c = s.chunks_per_rank;
  const bool a2a = s.kind == CollectiveKind::kAllToAllUlysses;
  const bool ring = s.order == PeerOrder::kRing;
  // Chunk of the block that `src` owns (AG) or sends `dst` (all-to-all).
  auto chunk = [&](int64_t src, int64_t dst, int64_t j) {
    return s.chunk_id(a2a ? src * W + dst : src, j);
  };
  s.steps.resize(W * c);
  for (int64_t i = 0; i < W; ++i) {
    for (int64_t j = 0; j < c; ++j) {
      ChunkStep& st = s.steps[i * c + j];
      const int64_t src = ring ? wrap(r - i, W) : wrap(r + i, W);
      st.compute = chunk(src, r, j);
      if (i > 0) st.input_waits.push_back({ring ? wrap(r - 1, W) : src, st.compute});
      if (i == W - 1) continue;  // the last c steps: every block has arrived
      if (!ring) {
        // Rank r-(i+1) computes r's block at its step (i+1)*c+j, c steps from now.
        const int64_t to = wrap(r - i - 1, W), from = wrap(r + i + 1, W);
        st.sends.push_back({to, chunk(r, to, j)});
        st.recvs.push_back({from, chunk(from, r, j)});
      } else if (!a2a) {
        // The block computed now is the one rank r+1 computes c steps from now.
        st.sends.push_back({wrap(r + 1, W), st.compute});
        st.recvs.push_back({wrap(r - 1, W), chunk(wrap(r - 1 - i, W), 0, j)});
      } else {
        // Blocks travel src -> src+1 -> ... -> dst, one hop per c steps; the hop into dst lands
        // c steps before dst places it. Here: src's blocks that go further than r.
        const int64_t prev_src = wrap(r - 1 - i, W);
        for (int64_t d = i + 1; d < W; ++d) {
          st.sends.push_back({wrap(r + 1, W), chunk(src, wrap(src + d, W), j)});
          st.recvs.push_back({wrap(r - 1, W), chunk(prev_src, wrap(prev_src + d, W), j)});
        }
      }
    }
  }
}

// GEMM-RS and reduce-scatter. Step i*c+j computes part j of destination r-1-i (own rows last);
// its result is sent one step later: the partial to its destination (direct) or the accumulator
// to r+1 (ring).
void reduce_steps(CollectiveSchedule& s) {
  const int64_t W = s.world_size, r = s.rank, c = s.chunks_per_rank, T = W * c;
  const bool ring = s.order == PeerOrder::kRing;
  s.steps.resize(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t i = t / c, j = t % c;
    ChunkStep& st = s.steps[t];
    const int64_t dest = wrap(r - 1 - i, W);
    st.compute = s.chunk_id(dest, j);
    if (ring && i > 0) st.fold_waits.push_back({wrap(r - 1, W), st.compute});
    if (!ring && i == W - 1) {
      // Own rows: fold every source's partial in reduce order, then this GEMM's.
      for (int64_t k = 1; k < W; ++k) st.fold_waits.push_back({wrap(r + k, W), st.compute});
    }
    if (t == 0) continue;
    const int64_t pi = (t - 1) / c, pj = (t - 1) % c;  // the previous step's chunk
    if (pi == W - 1) continue;                         // own rows need no transfer
    const int64_t pdest = wrap(r - 1 - pi, W);
    if (ring) {
      st.sends.push_back({wrap(r + 1, W), s.chunk_id(pdest, pj)});
      // Rank r-1's previous chunk: destination (r-1)-1-pi.
      st.recvs.push_back({wrap(r - 1, W), s.chunk_id(wrap(r - 2 - pi, W), pj)});
    } else {
      st.sends.push_back({pdest, s.chunk_id(pdest, pj)});
      // The rank whose previous chunk is ours: q - 1 - pi == r.
      st.recvs.push_back({wrap(r + 1 + pi, W), s.chunk_id(r, pj)});
    }
  }
}

}  // namespace

const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGatherMatmul:
      return "all_gather_matmul";
    case CollectiveKind::kMatmulReduceScatter:
      return "matmul_reduce_scatter";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllToAllUlysses:
      return "all_to_all_ulysses";
  }
  return "?";
}

const char* peer_order_name(PeerOrder order) {
  return order == PeerOrder::kRing ? "ring" : "direct";
}

PeerOrder parse_peer_order(const std::string& text) {
  if (text == "direct") return PeerOrder::kDirect;
  if (text == "ring") return PeerOrder::kRing;
  UNIEP_CHECK(false, "order must be \"direct\" or \"ring\", got \"", text, "\"");
  return PeerOrder::kDirect;
}

CollectiveKind parse_collective_kind(const std::string& text) {
  for (CollectiveKind k : {CollectiveKind::kAllGatherMatmul, CollectiveKind::kMatmulReduceScatter,
                           CollectiveKind::kAllGather, CollectiveKind::kReduceScatter,
                           CollectiveKind::kAllToAllUlysses}) {
    if (text == collective_kind_name(k)) return k;
  }
  UNIEP_CHECK(false,
              "kind must be one of all_gather_matmul, matmul_reduce_scatter, all_gather, "
              "reduce_scatter, all_to_all_ulysses; got \"",
              text, "\"");
  return CollectiveKind::kAllGather;
}

bool is_gather_kind(CollectiveKind kind) {
  return kind == CollectiveKind::kAllGatherMatmul || kind == CollectiveKind::kAllGather;
}

bool is_reduce_kind(CollectiveKind kind) {
  return kind == CollectiveKind::kMatmulReduceScatter || kind == CollectiveKind::kReduceScatter;
}

int64_t CollectiveSchedule::num_chunks() const {
  const int64_t blocks =
      kind == CollectiveKind::kAllToAllUlysses ? world_size * world_size : world_size;
  return blocks * chunks_per_rank;
}

std::vector<int64_t> reduce_order(int64_t world_size, int64_t dest) {
  UNIEP_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  UNIEP_CHECK(dest >= 0 && dest < world_size, "dest must be in [0, ", world_size, "), got ", dest);
  std::vector<int64_t> order;
  for (int64_t k = 1; k <= world_size; ++k) order.push_back((dest + k) % world_size);
  return order;
}

CollectiveSchedule make_schedule(CollectiveKind kind, int64_t world_size, int64_t rank,
                                 int64_t chunks_per_rank, PeerOrder order) {
  UNIEP_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  UNIEP_CHECK(rank >= 0 && rank < world_size, "rank must be in [0, ", world_size, "), got ", rank);
  UNIEP_CHECK(chunks_per_rank >= 1, "chunks must be >= 1, got ", chunks_per_rank);
  CollectiveSchedule s;
  s.kind = kind;
  s.order = order;
  s.world_size = world_size;
  s.rank = rank;
  s.chunks_per_rank = chunks_per_rank;
  if (is_reduce_kind(kind)) {
    reduce_steps(s);
  } else {
    gather_steps(s);
  }
  if (kind == CollectiveKind::kAllGather) {
    // Nothing to compute: keep the transfer steps only.
    s.steps.resize((world_size - 1) * chunks_per_rank);
    for (ChunkStep& st : s.steps) {
      st.compute = -1;
      st.input_waits.clear();
    }
  }
  return s;
}

}  // namespace uniep
