// P2P-decomposed collectives (after Flash-Overlap): all-gather + GEMM, GEMM + reduce-scatter, the
// plain all-gather / reduce-scatter and the Ulysses all-to-all, each rewritten as a schedule of
// peer-to-peer chunk transfers interleaved with a partitioned computation so that no
// communication is left exposed at the tail.
//
// A schedule is a plan, a pure function of (kind, world size, rank, chunks per rank, peer order):
// per step, which chunk the rank computes, which chunks it sends to and receives from which peer,
// and which arrivals (signals) the computation waits on. The CPU executor below runs it with plain
// loops over a PeerTransport; a CUDA executor runs the same plan with puts on a communication
// stream and one signal per received chunk.
//
// ---- Step model (what an executor must honour) ----
// Steps run in order. When step t starts, its sends are issued; they run alongside the step's
// compute. A receive raises the signal (peer, chunk) on the receiver when the data has landed.
//  - The compute of step t waits, before it starts, on `input_waits`: the arrivals it reads as
//    input (all-gather kinds, all-to-all). Those transfers were issued at a step < t.
//  - The epilogue of step t's compute waits on `fold_waits` and adds those arrivals, in the listed
//    order, before its own partial (reduce-scatter kinds). Those transfers were issued at a step
//    <= t: a fold may wait on the transfer that ran alongside its own GEMM.
//  - A send of a chunk the rank did not produce itself (ring forwarding) waits on that chunk's
//    arrival, which always comes from a transfer issued at an earlier step.
//  - Every rank has the same number of steps, and step t has transfers on every rank or on none
//    (lockstep), so a transport may implement a step as one collective exchange.
//
// ---- Chunks ----
// W ranks, c = chunks_per_rank, m = rows of one rank's block (divisible by c).
//  all-gather kinds:     chunk = owner * c + j: rows [j*m/c, (j+1)*m/c) of rank `owner`'s shard,
//                        rows owner*m + j*m/c ... of the gathered [W*m, K] tensor.
//  reduce-scatter kinds: chunk = dest * c + j: the same rows of the full [W*m, N] product (or
//                        input); after the reduction they are rows j*m/c ... of `dest`'s output.
//  all-to-all:           chunk = (src * W + dst) * c + j: part j of the block `src` sends `dst`.
//
// ---- Orders, and why each schedule is tail-free ----
// AG-GEMM (and the all-to-all): the local chunks are computed FIRST: they need no transfer, so the
// first GEMMs run while the first remote chunks arrive. Each remote chunk is sent exactly c steps
// before the receiver computes it (lookahead c: the transfers issued during the c local steps
// cover the first c remote GEMMs). Hence the last c steps issue nothing, and once the last GEMM
// starts every transfer has completed: nothing is outstanding after it.
//   direct: step i*c+j computes chunk (owner r+i, j); sends own chunk j to r-(i+1), receives chunk
//           j of r+(i+1) (a pairwise shift: every step is a permutation of the ranks).
//   ring:   step i*c+j computes chunk (owner r-i, j) and forwards that same chunk to r+1 (i < W-1);
//           receives from r-1 only.
// GEMM-RS (and the plain reduce-scatter): each rank computes its partial products for the other
// ranks' output rows first and its OWN rows LAST: the last GEMM's output needs no transfer, and
// the transfer issued alongside it (the previous chunk's result) is folded in its epilogue. Each
// result is sent one step after it is computed. Step i*c+j computes chunk (dest r-1-i, j), so
// destination d receives contributions in the order d+1, d+2, ..., d-1 and adds its own last.
//   direct: the partial (storage dtype) goes straight to its destination, which keeps one slot
//           per source and folds them in the epilogue of its own chunk's GEMM.
//   ring:   the accumulator (fp32; fp64 for float64) goes to r+1, which adds its partial to it;
//           the chain for destination d starts at d+1 and ends at d.
// Either way out[d] = (((P[d+1] + P[d+2]) + ...) + P[d-1]) + P[d] (ranks mod W) in fp32, each
// partial P[s] rounded to the storage dtype as a GEMM writes it: the bits depend neither on the
// order nor on the chunk count (reduce_order below).
// The plain all-gather is the AG-GEMM schedule without its computes (and without the last c
// steps, which then hold nothing).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uniep/cpu_executor.hpp"  // DType
#include "uniep/status.hpp"

namespace uniep {

enum class CollectiveKind {
  kAllGatherMatmul,
  kMatmulReduceScatter,
  kAllGather,
  kReduceScatter,
  kAllToAllUlysses,
};
enum class PeerOrder { kDirect, kRing };

const char* collective_kind_name(CollectiveKind kind);  // "all_gather_matmul", ...
const char* peer_order_name(PeerOrder order);           // "direct", "ring"
// Throws kInvalidArgument naming `order` unless text is "direct" or "ring".
PeerOrder parse_peer_order(const std::string& text);
// Throws kInvalidArgument naming `kind` unless text is one of the names above.
CollectiveKind parse_collective_kind(const std::string& text);

bool is_gather_kind(CollectiveKind kind);  // AG-GEMM, all-gather
bool is_reduce_kind(CollectiveKind kind);  // GEMM-RS, reduce-scatter

// One chunk crossing between this rank and `peer`: in a step's sends the destination, in its
// receives and waits the source.
struct Transfer {
  int64_t peer = -1;
  int64_t chunk = -1;

  bool operator==(const Transfer& o) const { return peer == o.peer && chunk == o.chunk; }
};

struct ChunkStep {
  std::vector<Transfer> sends;  // issued when the step starts
  std::vector<Transfer> recvs;  // what this rank's peers send it in this step
  // The chunk this step computes: AG-GEMM: the GEMM of that gathered-A chunk; GEMM-RS: the partial
  // product for that output chunk (plain reduce-scatter: the input rows, no GEMM); all-to-all: the
  // placement of that received block. -1: none (the plain all-gather).
  int64_t compute = -1;
  std::vector<Transfer> input_waits;  // arrivals the compute reads, waited on before it starts
  std::vector<Transfer> fold_waits;   // arrivals added, in order, in the compute's epilogue

  bool has_transfers() const { return !sends.empty() || !recvs.empty(); }
};

struct CollectiveSchedule {
  CollectiveKind kind = CollectiveKind::kAllGatherMatmul;
  PeerOrder order = PeerOrder::kDirect;
  int64_t world_size = 1;
  int64_t rank = 0;
  int64_t chunks_per_rank = 1;
  std::vector<ChunkStep> steps;

  // W * c chunks; W * W * c for the all-to-all.
  int64_t num_chunks() const;
  // AG kinds: owner; RS kinds: destination; all-to-all: source * W + destination.
  int64_t chunk_block(int64_t chunk) const { return chunk / chunks_per_rank; }
  int64_t chunk_part(int64_t chunk) const { return chunk % chunks_per_rank; }
  int64_t chunk_id(int64_t block, int64_t part) const { return block * chunks_per_rank + part; }
  // All-to-all only.
  int64_t chunk_src(int64_t chunk) const { return chunk_block(chunk) / world_size; }
  int64_t chunk_dst(int64_t chunk) const { return chunk_block(chunk) % world_size; }
};

// Throws kInvalidArgument naming the argument: world >= 1, 0 <= rank < world, chunks >= 1.
CollectiveSchedule make_schedule(CollectiveKind kind, int64_t world_size, int64_t rank,
                                 int64_t chunks_per_rank, PeerOrder order);

// The order in which the reduce-scatter kinds add the ranks' contributions to `dest`'s rows:
// dest+1, dest+2, ..., dest-1 (mod W), then dest itself.
std::vector<int64_t> reduce_order(int64_t world_size, int64_t dest);

// Checks the schedules of all ranks of one world (ranks[r].rank == r), and throws kInternal
// naming the rank, step and chunk of the first violation of:
//  - shape: same kind/order/W/c everywhere, as many steps on every rank, chunk ids and peers in
//    range, no self-transfers; lockstep (a step has transfers on all ranks or on none);
//  - matching: every send is matched by exactly one receive of the same chunk from the sender on
//    the peer in the same step, and every receive by a send;
//  - ring: sends go to rank+1 only, receives come from rank-1 only;
//  - data flow: a send carries data the sender holds when the step starts (its own, a result of
//    an earlier step, or an arrival from an earlier step); every chunk is computed exactly once
//    (AG-GEMM, GEMM-RS, reduce-scatter: all W*c; all-to-all: the W*c blocks addressed to the rank);
//    each rank ends up holding every chunk it needs, received at most once; a compute's
//    `input_waits` are exactly the arrival of its chunk when it is remote, issued at an earlier
//    step; `fold_waits` are arrivals of that chunk issued at a step <= this one;
//  - reduction: the contributions reaching each output chunk are exactly reduce_order(W, dest);
//  - tail-free: every step computes a chunk (none for the plain all-gather); AG-GEMM/all-to-all:
//    step 0 computes a local chunk and nothing is in flight once the last compute starts (every
//    arrival is consumed by a compute, which waits on it, at a later step); GEMM-RS/reduce-scatter:
//    the last step computes one of the rank's own chunks, and every arrival is folded no later
//    than the last step's epilogue, so nothing is outstanding after the last GEMM.
void validate_schedules(const std::vector<CollectiveSchedule>& ranks);

// ---- the CPU executor ----

struct PeerSend {
  int64_t peer = 0;
  int64_t tag = 0;  // the chunk id: unique among one step's messages between two ranks
  const void* data = nullptr;
  int64_t bytes = 0;
};
struct PeerRecv {
  int64_t peer = 0;
  int64_t tag = 0;
  void* data = nullptr;
  int64_t bytes = 0;
};

// Point-to-point transport: one exchange per schedule step. Every rank of the group calls the
// same sequence of all_gather / exchange (steps are lockstep across ranks).
class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  // out[r * n + i] = in_of_rank_r[i]
  virtual void all_gather(const int64_t* in, int64_t n, int64_t* out) = 0;
  // Posts every send and receive of one step and returns when all have completed.
  virtual void exchange(const std::vector<PeerSend>& sends, const std::vector<PeerRecv>& recvs) = 0;
};

// World of one rank: no peers, so exchange only accepts empty steps.
class LocalPeerTransport final : public PeerTransport {
 public:
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  void all_gather(const int64_t* in, int64_t n, int64_t* out) override;
  void exchange(const std::vector<PeerSend>& sends, const std::vector<PeerRecv>& recvs) override;
};

// Host pointers, row-major, contiguous. m = rows_per_rank.
//   AG-GEMM:    a [m, K] (this rank's shard), b [K, N]; gathered [W*m, K], out [W*m, N].
//   all-gather: a [m, K] (K = elements per row), gathered [W*m, K]; b and out unused (null).
// out = gathered @ b, each element accumulated over k ascending in fp32 (fp64 for float64) and
// rounded to dtype once; gathered is a bit-exact copy of the shards in rank order.
struct AllGatherArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* gathered = nullptr;
  void* out = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows_per_rank = 0;  // m, divisible by chunks
  int64_t k = 0;
  int64_t n = 0;
  int64_t chunks = 1;
  PeerOrder order = PeerOrder::kDirect;
  // all-gather: the shape of the caller's x ([m, ...], K = the product of its trailing dims), or
  // empty. Never read, only agreed on: ranks whose rows hold the same number of elements in
  // different layouts would otherwise exchange them silently.
  std::vector<int64_t> shape;
};
// kind: kAllGatherMatmul or kAllGather.
void cpu_all_gather(CollectiveKind kind, const AllGatherArgs& args, PeerTransport& transport);

//   GEMM-RS:        a [W*m, K_local], b [K_local, N]; out [m, N] = this rank's rows of
//                   sum over ranks of a @ b.
//   reduce-scatter: a [W*m, N] (the input), b unused (null), k unused; out [m, N].
// Partials are rounded to dtype (as a GEMM writes them) and added in reduce_order in fp32 (fp64
// for float64), then rounded once. K_local may differ across ranks; m, N must not.
struct ReduceScatterArgs {
  const void* a = nullptr;
  const void* b = nullptr;
  void* out = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows_per_rank = 0;  // m, divisible by chunks
  int64_t k = 0;
  int64_t n = 0;
  int64_t chunks = 1;
  PeerOrder order = PeerOrder::kDirect;
  std::vector<int64_t> shape;  // reduce-scatter: the caller's x [W*m, ...], or empty; agreed on
};
// kind: kMatmulReduceScatter or kReduceScatter.
void cpu_reduce_scatter(CollectiveKind kind, const ReduceScatterArgs& args,
                        PeerTransport& transport);

//   send [W][block_bytes]: block p goes to rank p; recv [W][block_bytes]: block s came from rank
//   s. block_bytes divisible by chunks. The Ulysses re-layout around it lives with the caller.
struct AllToAllArgs {
  const void* send = nullptr;
  void* recv = nullptr;
  DType dtype = DType::kFloat32;  // only agreed on across ranks; the data moves as bytes
  int64_t block_bytes = 0;
  int64_t chunks = 1;
  PeerOrder order = PeerOrder::kDirect;
  // The caller's layout, only agreed on like dtype (the bytes do not pin it down): the shape of
  // its x, or empty, and the dims it scatters and gathers, in [0, x.dim()).
  std::vector<int64_t> shape;
  int64_t scatter_dim = 0;
  int64_t gather_dim = 0;
};
void cpu_all_to_all(const AllToAllArgs& args, PeerTransport& transport);

// W equal blocks of a contiguous tensor, each a run of `rows` rows of `row_bytes`, row i of
// block p at base + p * block_stride + i * pitch. Packed, a block is its rows back to back
// (block_bytes = rows * row_bytes): the C-order bytes of that slice of the tensor.
struct StridedBlocks {
  int64_t rows = 0;
  int64_t row_bytes = 0;
  int64_t pitch = 0;
  int64_t block_stride = 0;
};

// Where the blocks of all_to_all_ulysses lie: block p of x (shape, contiguous) is its p-th slice
// along scatter_dim, sent to rank p; the block from rank s is the s-th slice of the output along
// gather_dim. Executors move the blocks straight between the caller's tensors and the transfer
// (the CUDA executor's copies are 2-D), with no pack or unpack copy around the exchange.
struct UlyssesLayout {
  int64_t block_bytes = 0;
  StridedBlocks send;  // in x
  StridedBlocks recv;  // in the output
  std::vector<int64_t> out_shape;
};
// Throws kInvalidArgument naming the argument: dims out of range or equal, or
// shape[scatter_dim] not divisible by world_size.
UlyssesLayout ulysses_layout(const std::vector<int64_t>& shape, int64_t scatter_dim,
                             int64_t gather_dim, int64_t world_size, int64_t element_bytes);
// packed [W][block_bytes] <-> the W strided blocks of a tensor (host memory).
void pack_blocks(const StridedBlocks& blocks, int64_t world_size, const void* tensor,
                 void* packed);
void unpack_blocks(const StridedBlocks& blocks, int64_t world_size, const void* packed,
                   void* tensor);

// Each cpu_* call first exchanges its parameters (the shape and dims above included) and this
// rank's verdict on them, so that a mismatch (or a bad argument on one rank) fails every rank
// with the same message, naming the field and rank 0's value against the first rank that differs,
// instead of leaving the peers blocked in a transfer (or exchanging mislaid data). A caller whose
// own argument checks failed calls this instead of the executor: it takes part in that exchange,
// then throws `error` here (the peers throw an error naming this rank).
[[noreturn]] void fail_collective_call(CollectiveKind kind, const Error& error,
                                       PeerTransport& transport);

}  // namespace uniep
