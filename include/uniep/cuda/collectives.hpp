// The CUDA executor of the P2P-decomposed collectives (uniep/collectives.hpp holds the schedules
// and the CPU executor). It runs the same per-rank schedule on one node whose GPUs all reach each
// other over NVLink (nvshmem_ptr):
//  - transfers are copy-engine copies (through the peer mapping, with the driver's hint to
//    overlap compute) on the runtime's communication stream, so they take no SM from the GEMMs
//    they overlap; the signal after each is the driver's stream write where the device has one
//    (else a one-thread kernel). The runtime's streams have the highest priority, so its small
//    kernels (waits, folds) go before a GEMM's blocks that have not started yet;
//  - every kind PUSHES: a shard, partial or block is copied from the caller's tensor into the
//    destination's symmetric slot (all-gather kinds: at once, in the schedule's send order;
//    reduce-scatter kinds: as soon as each partial is computed), followed by a signal the
//    destination waits on (a bounded device wait) before it reads the slot: a GEMM reads the
//    gathered rows from the slot itself, while a copy on a third stream also puts them into the
//    caller's gathered tensor (beside the pushes, like the copy of the rank's own shard); a fold
//    adds the partials; the all-to-all places the block;
//  - the computation runs on the caller's stream, in the schedule's step order: a remote chunk's
//    GEMM waits on that chunk's copy (an event), and the rank's own chunks fill the slot that
//    would otherwise be the exposed tail. With parts_gemm one persistent GEMM runs instead: an
//    all-gather + GEMM's is launched at once and its tiles wait on the device for their part's
//    arrival word; a GEMM + reduce-scatter's announces each part's stored tiles, on which the
//    communication stream waits (no SM) before it pushes the part;
// No call starts with a barrier: the push slots come in two sets, one for calls of odd epoch and
// one for even, and the arrival waits of a call prove that every peer has finished the call before
// it (so its slots for the next call are free). The ranks stay at most one call apart; every wait
// is bounded by Config::timeout_s.
// The host never synchronises: a timeout sets an error word that the next call on this runtime,
// or check_device_errors(), turns into a kTimeout Status naming the operation and the peer.
//
// Results do not depend on arrival order: the all-gather copies bytes, and the reduce-scatter adds
// the partials in reduce_order (fp32; fp64 for float64) exactly like the CPU executor. A GEMM that
// folds the addend (RowGemm::folds_addend) adds the peers' partials (their reduce-order sum in
// fp32, rounded once, where there are several) to its fp32 accumulator instead, which rounds the
// own partial once less: deterministic, but not the CPU executor's bits. Not capturable in a CUDA
// graph: each call's signals carry a fresh epoch from the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "uniep/collectives.hpp"  // StridedBlocks
#include "uniep/cpu_executor.hpp"  // DType
#include "uniep/cuda/part_gemm.hpp"
#include "uniep/status.hpp"

namespace uniep::coll {

constexpr int64_t kMaxRanks = 16;   // ranks of one NVLink domain this executor addresses
constexpr int64_t kMaxChunks = 64;  // chunks per rank of one call

struct Config {
  int64_t world_size = 1;
  int64_t rank = 0;
  // The largest block one rank moves in a call: all-gather kinds: rows_per_rank * row_bytes;
  // reduce-scatter kinds: rows_per_rank * n * dtype size; all-to-all: block_bytes. The symmetric
  // heap holds 2 * world_size slots of this size (two sets: no barrier per call).
  int64_t max_block_bytes = 0;
  double timeout_s = 100.0;  // every device-side wait
  // The world ranks (NVSHMEM PEs) this runtime's calls run between, ascending, `rank` among
  // them; empty: all world_size ranks. The calls' W and ranks are the group's (group_size(),
  // group_rank()): a sub-group's collectives move only its own blocks. Every rank of the world
  // creates (and destroys) its runtime at once, each with its own group and the same
  // max_block_bytes, since the symmetric heap is allocated over all of them; every rank of a
  // group gives the same members (the groups partition the world).
  std::vector<int64_t> members;

  int64_t group_size() const;
  int64_t group_rank() const;  // -1 where members lacks rank
  Status validate() const;
};

// Bytes of NVSHMEM symmetric heap a runtime with this config allocates.
size_t symmetric_heap_bytes(const Config& config);

// Enqueues out_rows[rows] = a_rows[rows] @ B (+ addend_rows[rows]) on `stream` (the caller's; B,
// K, N and the dtype are the callback's business). addend_rows is null unless folds_addend is
// set: then a GEMM + reduce-scatter hands each of its own rows' GEMMs the sum of the peers'
// partials to add in its epilogue, and no fold is left after the last GEMM. Returns a non-ok
// Status to abort the call.
struct RowGemm {
  Status (*run)(void* ctx, const void* a_rows, const void* addend_rows, void* out_rows,
                int64_t rows, cudaStream_t stream) = nullptr;
  void* ctx = nullptr;
  bool folds_addend = false;
};

// A collective + GEMM as one persistent GEMM over all its parts (uniep/cuda/part_gemm.hpp)
// instead of one GEMM per part: the runtime lists the W * chunks parts in the schedule's
// compute order and the callback enqueues cuda::part_gemm_bf16 (with B) on `stream` once.
//  - all-gather + GEMM: the own shard's parts first; each part's rows where they are (the
//    caller's shard or the slot the peer pushed into) and its arrival word (null for the own
//    parts); `gate` carries the call's epoch, the timeout and the runtime's timeout record.
//  - GEMM + reduce-scatter: the peers' parts first, the own last, into the scratch rows, no
//    gate; `done` takes the parts' stored row tiles (PartGemmProblem::done), on which the
//    pushes of the partials wait.
// The GEMM's grid must leave at least `spare_sms` SMs of the device free (1 where a peer shares
// this GPU: the pushes between them are copies on SMs, which the peers' gated tiles wait for).
struct PartsGemm {
  Status (*run)(void* ctx, const cuda::GemmPart* parts, int64_t count, int64_t rows,
                const cuda::PartGate& gate, int spare_sms, uint32_t* done,
                cudaStream_t stream) = nullptr;
  void* ctx = nullptr;
};

// all-gather (gemm.run null) and all-gather + GEMM. Device pointers, row-major, contiguous.
struct AllGatherCall {
  const void* a = nullptr;   // [m] rows of row_bytes: this rank's shard
  void* gathered = nullptr;  // [W*m] rows: every rank's shard in rank order
  int64_t rows_per_rank = 0;
  int64_t row_bytes = 0;  // multiple of 16
  int64_t chunks = 1;     // divides rows_per_rank
  RowGemm gemm{};
  // Where set (with gemm.run set too): the one gated GEMM instead of gemm's per-part GEMMs.
  // gemm.run stays the fallback where the device lacks the driver's stream writes (the signals
  // would then be kernels, which the peers' persistent GEMMs could keep from any SM).
  PartsGemm parts_gemm{};
  void* out = nullptr;        // [W*m] rows of out_row_bytes: gathered @ B
  int64_t out_row_bytes = 0;  // bytes of one output row
};

// reduce-scatter (gemm.run null: the partials are the rows of `a`) and GEMM + reduce-scatter.
struct ReduceScatterCall {
  DType dtype = DType::kBFloat16;  // of the partials and the output
  const void* a = nullptr;         // [W*m] rows of a_row_bytes (reduce-scatter: [W*m, n])
  int64_t a_row_bytes = 0;
  void* scratch = nullptr;  // GEMM + RS: [W*m, n] partials as the GEMM writes them; else unused
  void* out = nullptr;      // [m, n]: this rank's rows of the sum over ranks
  int64_t rows_per_rank = 0;
  int64_t n = 0;       // elements of one output row; n * dtype size a multiple of 16
  int64_t chunks = 1;  // divides rows_per_rank
  RowGemm gemm{};
  // Where set (with gemm.run set too; bf16): the one GEMM instead of gemm's per-part GEMMs, its
  // partials pushed as their tiles are stored. gemm.run stays the fallback where the driver has
  // no stream waits.
  PartsGemm parts_gemm{};
};

// The all-to-all: send [W][block_bytes] (block p to rank p) -> recv [W][block_bytes] (block s
// from rank s), or strided blocks where send_blocks / recv_blocks have rows > 0 (the Ulysses
// layouts, uniep::ulysses_layout): block p of send is then send_blocks' p-th run of rows, moved
// by 2-D copies with no pack or unpack. Chunk j of a block is its j-th run of rows / chunks rows
// (or bytes, contiguous), so chunks divides both sides' rows.
struct AllToAllCall {
  const void* send = nullptr;
  void* recv = nullptr;
  int64_t block_bytes = 0;  // divisible by chunks
  int64_t chunks = 1;
  StridedBlocks send_blocks{};  // rows 0: contiguous
  StridedBlocks recv_blocks{};
};

class Runtime {
 public:
  // Collective over the group: rank 0's unique id (uniep::ep::make_unique_id) broadcast by the
  // framework. Shares NVSHMEM with the expert-parallel runtime of the same ranks.
  static Status create(const Config& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<Runtime>* runtime);
  virtual ~Runtime() = default;  // collective: every rank destroys its runtime together

  virtual const Config& config() const = 0;
  // Calls are enqueued on `stream` (the caller's) and return without synchronising. Every rank
  // of the group makes the same calls in the same order with the same shapes.
  virtual Status all_gather(const AllGatherCall& call, cudaStream_t stream) = 0;
  virtual Status reduce_scatter(const ReduceScatterCall& call, cudaStream_t stream) = 0;
  virtual Status all_to_all(const AllToAllCall& call, cudaStream_t stream) = 0;
  // The error a device wait recorded (kTimeout naming the operation and the peer), cleared once
  // returned. synchronize: wait for the device first.
  virtual Status check_device_errors(bool synchronize) = 0;
};

}  // namespace uniep::coll
