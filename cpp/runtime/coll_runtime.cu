// The collectives runtime (uniep/cuda/collectives.hpp): one symmetric allocation holding the
// arrival words and two sets of push slots, and the host
// side that walks a rank's schedule (uniep/collectives.hpp) and enqueues its copies, waits and
// computations on the caller's stream and the runtime's three.
#include <cuda.h>  // types of the driver's stream write, fetched at run time (no -lcuda)
#include <cuda_runtime.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cuda/collectives/coll_kernels.hpp"
#include "runtime/nvshmem_session.hpp"
#include "runtime/runtime_support.hpp"
#include "uniep/collectives.hpp"
#include "uniep/cuda/collectives.hpp"

namespace uniep::coll {
namespace {

using cuda::DeviceError;

// Offsets in the symmetric allocation; the same on every rank.
//
// The push slots come in two sets, used by calls of odd and even epoch, so no call needs a
// barrier before it pushes: a peer's set for epoch e was last read in its call e - 2, and that
// call was complete before the peer's pushes of call e - 1 (a call's pushes wait for the previous
// call's done_event, recorded on its caller's stream after everything that read the slots, even
// when the two calls come on different streams), whose arrival signals this rank waited for in
// its call e - 1 (every kind receives from every peer it pushes to). So the slots are free by the
// time this rank's call e starts; ranks stay at most one call apart.
struct Carve {
  size_t arrived;  // uint64 [kMaxRanks][kMaxChunks]: the epoch of each peer's last push of part j
  size_t push;     // [2][world_size] slots of max_block_bytes: what each peer pushed here
  size_t total;
};

Carve carve(const Config& c) {
  Carve v{};
  runtime::HeapCarver heap;
  const size_t B = static_cast<size_t>(c.max_block_bytes);
  v.arrived = heap.take(sizeof(uint64_t) * kMaxRanks * kMaxChunks);
  v.push = heap.take(2 * B * static_cast<size_t>(c.world_size));
  v.total = heap.total();
  return v;
}

int64_t dtype_bytes(DType d) {
  return d == DType::kBFloat16 ? 2 : d == DType::kFloat32 ? 4 : 8;
}

// A copy with the driver's hint to overlap compute. A cudaMemcpyAsync between two addresses of
// this GPU behaves as an SM copy: beside a GEMM that fills every SM it starts only in the GEMM's
// last wave (TP=2 traces). cudaMemcpyBatchAsync carries the hint that asks for a copy engine
// instead; on the lent H200s the driver still kept local copies on SMs, while copies to a peer ran
// on a copy engine either way. Where the batch call is refused, the plain copy.
cudaError_t copy_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  void* dsts[1] = {dst};
  const void* srcs[1] = {src};
  size_t sizes[1] = {bytes};
  size_t first[1] = {0};
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  const cudaError_t e = cudaMemcpyBatchAsync(dsts, srcs, sizes, 1, &attr, first, 1, stream);
  if (e != cudaErrorNotSupported && e != cudaErrorInvalidValue) return e;
  (void)cudaGetLastError();
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
}

// `height` rows of `width` bytes, one pitch apart on each side: the copy engine's 2-D copy, or
// the copy above where both sides are contiguous.
cudaError_t copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                    size_t height, cudaStream_t stream) {
  if (width == 0 || height == 0) return cudaSuccess;
  if (dpitch == width && spitch == width) return copy_async(dst, src, width * height, stream);
  return cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice,
                           stream);
}

// One side of an all-to-all block: rows of row_bytes one pitch apart, blocks one stride apart.
// The contiguous layout is `chunks` rows of block_bytes / chunks per block, so that a chunk is a
// run of whole rows either way.
struct BlockRows {
  int64_t rows, row_bytes, pitch, stride;
  static BlockRows of(const StridedBlocks& b, int64_t block_bytes, int64_t chunks) {
    if (b.rows == 0) {
      const int64_t w = block_bytes / chunks;
      return {chunks, w, w, block_bytes};
    }
    return {b.rows, b.row_bytes, b.pitch, b.block_stride};
  }
  // The first row of chunk j of block p (each chunk is rows / chunks rows).
  const uint8_t* at(const uint8_t* base, int64_t p, int64_t j, int64_t chunks) const {
    return base + p * stride + j * (rows / chunks) * pitch;
  }
};

// A driver entry point fetched at run time (no -lcuda), or nullptr where the driver lacks it.
template <typename Fn>
Fn driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

// The driver's stream write (no SM needed, so it is not queued behind a GEMM's blocks as a
// signal kernel is). A device without 64-bit stream memory operations answers
// CUDA_ERROR_NOT_SUPPORTED at the first write (see signal()).
using StreamWriteValue64 = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
// The driver's stream wait on a 32-bit word (the stream stalls on the GPU's front end, no SM);
// without it a GEMM + reduce-scatter runs its chunk GEMMs.
using StreamWaitValue32 = CUresult(CUDAAPI*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

class RuntimeImpl final : public Runtime {
 public:
  explicit RuntimeImpl(const Config& c)
      : cfg_(c), layout_(carve(c)), W_(c.group_size()), r_(c.group_rank()) {}
  ~RuntimeImpl() override {
    // nvshmem_free is collective: the runtime is destroyed by every rank together
    // (uniep.collectives.shutdown_cuda), never from a static destructor.
    for (cudaStream_t st : {comm_, wait_, copy_})
      if (st) cudaStreamSynchronize(st);
    heap_.close();
    for (cudaEvent_t& e : events_)
      if (e) cudaEventDestroy(e);
    for (cudaStream_t st : {comm_, wait_, copy_})
      if (st) cudaStreamDestroy(st);
    if (err_host_) cudaFreeHost(err_host_);
    if (gate_host_) cudaFreeHost(gate_host_);
    if (done_) cudaFree(done_);
  }

  Status init(const std::vector<uint8_t>& uid) {
    if (Status s =
            heap_.open(uid, cfg_.world_size, cfg_.rank, layout_.total, " for the collectives",
                       "lower max_block_bytes or raise NVSHMEM_SYMMETRIC_SIZE (set before "
                       "the first UniEP runtime)");
        !s.ok())
      return s;
    if (Status s = heap_.map_peers(peer_, "the CUDA collectives need",
                                   "use NCCL (or the CPU executor) across nodes");
        !s.ok())
      return s;
    for (int64_t g = 0; g < W_; ++g) group_peer_[g] = peer_[world_rank(g)];
    // Copies through the peer mappings are peer copies to the CUDA runtime: with peer access
    // enabled they run on the copy engine over NVLink instead of being staged.
    if (Status s = enable_peer_access(); !s.ok()) return s;
    // The words must read zero everywhere before any peer may store into them.
    UNIEP_CUDA_OK(cudaMemset(heap_.base(), 0, layout_.push));
    if (Status s = heap_.barrier(); !s.ok()) return s;

    // The runtime's streams have the highest priority, so their kernels (the waits, the folds)
    // go before a GEMM's blocks that have not started yet. cuBLAS's persistent Hopper GEMMs start
    // them all at once, so beside those they still wait for the last wave (TP=2 traces).
    int least = 0, greatest = 0;
    UNIEP_CUDA_OK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    // Pushes and signals. Arrival waits spin on their own stream: never on the caller's, which
    // may be the legacy default stream that other work (a peer copy) can be made to wait behind.
    // Copies within this GPU (into the gathered output) have a third, so that they run beside
    // the pushes.
    for (cudaStream_t* st : {&comm_, &wait_, &copy_})
      UNIEP_CUDA_OK(cudaStreamCreateWithPriority(st, cudaStreamNonBlocking, greatest));
    // All pushes share the one communication stream, in the schedule's send order. One stream
    // per peer (the copies to different peers at once) was slower on four H200s: a plain
    // all-gather of 512 MiB took 1.93 ms instead of 1.40, and the first chunk an AG+GEMM needs
    // arrived later (2026-11-26, commit cff9c71 against 9b4addf).
    write_value_ = driver_entry<StreamWriteValue64>("cuStreamWriteValue64");
    wait_value_ = driver_entry<StreamWaitValue32>("cuStreamWaitValue32");
    for (cudaEvent_t& e : events_)
      UNIEP_CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    UNIEP_CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&err_host_), sizeof(DeviceError),
                                cudaHostAllocMapped));
    std::memset(err_host_, 0, sizeof(DeviceError));
    UNIEP_CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&err_dev_), err_host_, 0));
    UNIEP_CUDA_OK(cudaHostAlloc(reinterpret_cast<void**>(&gate_host_), sizeof(cuda::GateTimeout),
                                cudaHostAllocMapped));
    *gate_host_ = cuda::GateTimeout{};
    UNIEP_CUDA_OK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&gate_dev_), gate_host_, 0));
    int device = 0;
    UNIEP_CUDA_OK(cudaGetDevice(&device));
    UNIEP_CUDA_OK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
    return Status::Ok();
  }

  const Config& config() const override { return cfg_; }

  Status all_gather(const AllGatherCall& c, cudaStream_t stream) override {
    const bool gemm = c.gemm.run != nullptr;
    const CollectiveKind kind =
        gemm ? CollectiveKind::kAllGatherMatmul : CollectiveKind::kAllGather;
    if (Status s = check_rows(c.rows_per_rank, c.chunks, "rows_per_rank"); !s.ok()) return s;
    if (c.row_bytes < 1) return bad(detail::str_cat("row_bytes must be >= 1, got ", c.row_bytes));
    if (Status s = check_block(c.rows_per_rank * c.row_bytes, "rows_per_rank * row_bytes"); !s.ok())
      return s;
    if (!c.a || !c.gathered) return bad("a and gathered must be device pointers, got null");
    if (gemm && (!c.out || c.out_row_bytes < 1))
      return bad("an all-gather + GEMM needs out and out_row_bytes >= 1");
    CollectiveSchedule plan;
    if (Status s = plan_for(kind, c.chunks, &plan); !s.ok()) return s;
    if (Status s = begin(kind, stream); !s.ok()) return s;

    const int64_t W = W_, r = r_, m = c.rows_per_rank;
    const int64_t mc = m / c.chunks, rb = c.row_bytes, part = mc * rb;
    const auto* a = static_cast<const uint8_t*>(c.a);
    auto* gathered = static_cast<uint8_t*>(c.gathered);

    UNIEP_CUDA_OK(cudaEventRecord(start_event(), stream));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, start_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, done_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(wait_, start_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(copy_, start_event(), 0));
    UNIEP_CUDA_OK(copy_async(gathered + r * m * rb, a, m * rb, copy_));
    // Our shard goes straight from the caller's tensor into each peer's slot for us, in the
    // plan's send order (the peer that computes our block soonest first). A push needs no copy
    // of the shard into our own symmetric memory first, which a pull does before its peers may
    // read it: that copy was the one transfer left exposed.
    for (const ChunkStep& st : plan.steps) {
      for (const Transfer& t : st.sends) {
        const int64_t j = plan.chunk_part(t.chunk);
        if (Status s =
                push(t.peer, push_slot(r) + j * part, a + j * part, part, arrived_word(r, j));
            !s.ok())
          return finish(stream, s);
      }
    }
    // Arrivals in the plan's receive order: each is waited for on the wait stream, then copied
    // into the caller's gathered tensor on the local copy stream (our own shard went first). The
    // GEMMs read the slots directly and never wait for those copies.
    for (const ChunkStep& st : plan.steps) {
      for (const Transfer& t : st.recvs) {
        const int64_t owner = plan.chunk_block(t.chunk), j = plan.chunk_part(t.chunk);
        cuda::launch_coll_wait(words(layout_.arrived) + j, kMaxChunks, static_cast<int>(W),
                               static_cast<int>(r), static_cast<int>(owner), epoch_, timeout_ns(),
                               err_dev_, op_code(kind), wait_);
        UNIEP_CUDA_OK(cudaEventRecord(chunk_event(t.chunk), wait_));
        UNIEP_CUDA_OK(cudaStreamWaitEvent(copy_, chunk_event(t.chunk), 0));
        UNIEP_CUDA_OK(copy_async(gathered + (owner * m + j * mc) * rb,
                                 sym() + push_slot(owner) + j * part, part, copy_));
      }
    }
    Status status = Status::Ok();
    // The one gated GEMM needs the peers' signals to take no SM (their GEMMs hold all of them):
    // the driver's stream write, which a device without it has just been found to lack.
    if (gemm && c.parts_gemm.run != nullptr && (write_value_ != nullptr || W == 1)) {
      auto* out = static_cast<uint8_t*>(c.out);
      std::vector<cuda::GemmPart> parts;
      parts.reserve(plan.steps.size());
      for (const ChunkStep& st : plan.steps) {
        const int64_t owner = plan.chunk_block(st.compute), j = plan.chunk_part(st.compute);
        cuda::GemmPart p;
        p.out = out + (owner * m + j * mc) * c.out_row_bytes;
        if (owner == r) {
          p.a = a + j * part;
        } else {
          p.a = sym() + push_slot(owner) + j * part;
          p.ready = words(layout_.arrived) + owner * kMaxChunks + j;
        }
        parts.push_back(p);
      }
      gated_chunks_[epoch_ % kGatedHistory] = c.chunks;
      cuda::PartGate gate;
      gate.epoch = epoch_;
      gate.timeout_ns = timeout_ns();
      gate.timeout = gate_dev_;
      // A push to a rank on this same GPU is a copy on SMs (the driver keeps copies within a
      // device on SMs), which a GEMM holding every SM would keep waiting for ever.
      status = c.parts_gemm.run(c.parts_gemm.ctx, parts.data(), static_cast<int64_t>(parts.size()),
                                mc, gate, shares_device_ ? 1 : 0, nullptr, stream);
    } else if (gemm) {
      auto* out = static_cast<uint8_t*>(c.out);
      for (const ChunkStep& st : plan.steps) {
        const int64_t owner = plan.chunk_block(st.compute), j = plan.chunk_part(st.compute);
        const uint8_t* rows = a + j * part;
        if (owner != r) {
          UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, chunk_event(st.compute), 0));
          rows = sym() + push_slot(owner) + j * part;
        }
        status = c.gemm.run(c.gemm.ctx, rows, nullptr, out + (owner * m + j * mc) * c.out_row_bytes,
                            mc, stream);
        if (!status.ok()) break;
      }
    }
    return finish(stream, status);
  }

  Status reduce_scatter(const ReduceScatterCall& c, cudaStream_t stream) override {
    const bool gemm = c.gemm.run != nullptr;
    const CollectiveKind kind =
        gemm ? CollectiveKind::kMatmulReduceScatter : CollectiveKind::kReduceScatter;
    if (Status s = check_rows(c.rows_per_rank, c.chunks, "rows_per_rank"); !s.ok()) return s;
    if (c.n < 1) return bad(detail::str_cat("n must be >= 1, got ", c.n));
    const int64_t es = dtype_bytes(c.dtype), rb = c.n * es;
    if (Status s = check_block(c.rows_per_rank * rb, "rows_per_rank * n * dtype size"); !s.ok())
      return s;
    if (!c.a || !c.out) return bad("a and out must be device pointers, got null");
    if (gemm && !c.scratch) return bad("a GEMM + reduce-scatter needs scratch ([W*m, n])");
    if (!gemm && c.a_row_bytes != rb)
      return bad(detail::str_cat("a reduce-scatter's input rows are n * dtype size = ", rb,
                                 " bytes, got a_row_bytes ", c.a_row_bytes));
    CollectiveSchedule plan;
    if (Status s = plan_for(kind, c.chunks, &plan); !s.ok()) return s;
    if (Status s = begin(kind, stream); !s.ok()) return s;

    const int64_t W = W_, r = r_, m = c.rows_per_rank;
    const int64_t mc = m / c.chunks, part = mc * rb;
    const auto* a = static_cast<const uint8_t*>(c.a);
    // Where the partial of (destination, part) is: the GEMM's scratch rows, or the input rows.
    const uint8_t* partials = gemm ? static_cast<const uint8_t*>(c.scratch) : a;
    auto partial = [&](int64_t chunk) {
      return partials + (plan.chunk_block(chunk) * m + plan.chunk_part(chunk) * mc) * rb;
    };
    auto* out = static_cast<uint8_t*>(c.out);

    UNIEP_CUDA_OK(cudaEventRecord(start_event(), stream));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, start_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, done_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(wait_, start_event(), 0));
    if (gemm && c.parts_gemm.run != nullptr && wait_value_ != nullptr && W > 1)
      return finish(stream, reduce_scatter_one_gemm(c, plan, stream));
    Status status = Status::Ok();
    // Pushes go on the communication stream as soon as their partial exists (the input rows
    // exist from the start); they are enqueued before any wait for arrivals, so no host call
    // of the copy path can end up queued behind a wait that needs a peer's push.
    auto enqueue_sends = [&](const ChunkStep& st) -> Status {
      for (const Transfer& t : st.sends) {
        if (gemm) UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, chunk_event(t.chunk), 0));
        const int64_t j = plan.chunk_part(t.chunk);
        if (Status s =
                push(t.peer, push_slot(r) + j * part, partial(t.chunk), part, arrived_word(r, j));
            !s.ok())
          return s;
      }
      return Status::Ok();
    };
    if (!gemm) {
      for (const ChunkStep& st : plan.steps)
        if (Status s = enqueue_sends(st); !s.ok()) return finish(stream, s);
    }
    // Part j of this call from every peer: waited for on the wait stream. The peers' slots of
    // part j, in the step's fold order (the reduce order), go into `in`; returns their count.
    auto wait_part = [&](int64_t j) {
      cuda::launch_coll_wait(words(layout_.arrived) + j, kMaxChunks, static_cast<int>(W),
                             static_cast<int>(r), -1, epoch_, timeout_ns(), err_dev_, op_code(kind),
                             wait_);
    };
    auto peer_slots = [&](const ChunkStep& st, int64_t j, cuda::ReduceInputs* in) {
      int count = 0;
      for (const Transfer& f : st.fold_waits)
        in->in[count++] = sym() + push_slot(f.peer) + j * part;
      return count;
    };
    // The peers' partials of own part j, as one addend for the GEMM of that part: the slot
    // itself where one peer sent it, else their fold into the part's scratch rows, which the own
    // partial does not use.
    auto addend_for = [&](const ChunkStep& st, int64_t j, const void** addend) -> Status {
      *addend = nullptr;
      if (st.fold_waits.empty()) return Status::Ok();
      wait_part(j);
      cuda::ReduceInputs in{};
      const int count = peer_slots(st, j, &in);
      *addend = in.in[0];
      if (count > 1) {
        cuda::launch_coll_reduce(c.dtype, in, count, const_cast<uint8_t*>(partial(st.compute)),
                                 mc * c.n, sm_count_, wait_);
        *addend = partial(st.compute);
      }
      UNIEP_CUDA_OK(cudaGetLastError());
      UNIEP_CUDA_OK(cudaEventRecord(chunk_event(st.compute), wait_));
      UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, chunk_event(st.compute), 0));
      return Status::Ok();
    };
    // The caller's stream: the partials in plan order, each remote one pushed one step later;
    // the own rows last, each folded as soon as its GEMM is done (the plan's epilogue folds):
    // in the GEMM's own epilogue where it folds an addend, else by a kernel on the wait stream.
    const bool epilogue_fold = gemm && c.gemm.folds_addend;
    for (size_t t = 0; t < plan.steps.size(); ++t) {
      const ChunkStep& st = plan.steps[t];
      const int64_t dest = plan.chunk_block(st.compute), j = plan.chunk_part(st.compute);
      if (gemm) {
        const uint8_t* rows = a + (dest * m + j * mc) * c.a_row_bytes;
        if (epilogue_fold && dest == r) {
          const void* addend = nullptr;
          status = addend_for(st, j, &addend);
          if (status.ok())
            status = c.gemm.run(c.gemm.ctx, rows, addend, out + j * part, mc, stream);
        } else {
          status = c.gemm.run(c.gemm.ctx, rows, nullptr, const_cast<uint8_t*>(partial(st.compute)),
                              mc, stream);
        }
        if (!status.ok()) break;
        if (dest != r) UNIEP_CUDA_OK(cudaEventRecord(chunk_event(st.compute), stream));
        if (t + 1 < plan.steps.size()) {
          status = enqueue_sends(plan.steps[t + 1]);
          if (!status.ok()) break;
        }
      }
      if (dest != r || epilogue_fold) continue;
      // The fold of own part j runs beside the GEMM of part j+1 (on the wait stream, after
      // that part's arrivals and its own partial): only the last part's fold is left at the end.
      cuda::ReduceInputs in{};
      int count = peer_slots(st, j, &in);
      in.in[count++] = partial(st.compute);
      if (gemm) {
        UNIEP_CUDA_OK(cudaEventRecord(chunk_event(st.compute), stream));
        UNIEP_CUDA_OK(cudaStreamWaitEvent(wait_, chunk_event(st.compute), 0));
      }
      if (W > 1) wait_part(j);
      cuda::launch_coll_reduce(c.dtype, in, count, out + j * part, mc * c.n, sm_count_, wait_);
      UNIEP_CUDA_OK(cudaGetLastError());
    }
    UNIEP_CUDA_OK(cudaEventRecord(folded_event(), wait_));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, folded_event(), 0));
    return finish(stream, status);
  }

  Status all_to_all(const AllToAllCall& c, cudaStream_t stream) override {
    const CollectiveKind kind = CollectiveKind::kAllToAllUlysses;
    if (c.chunks < 1 || c.chunks > kMaxChunks)
      return bad(detail::str_cat("chunks must be in [1, ", kMaxChunks, "], got ", c.chunks));
    if (c.block_bytes < 0 || c.block_bytes % c.chunks != 0)
      return bad(detail::str_cat("block_bytes (", c.block_bytes,
                                 ") must be >= 0 and divisible by chunks (", c.chunks, ")"));
    if (Status s = check_block(c.block_bytes, "block_bytes"); !s.ok()) return s;
    if (!c.send || !c.recv) return bad("send and recv must be device pointers, got null");
    if (Status s = check_strided(c.send_blocks, c, "send_blocks"); !s.ok()) return s;
    if (Status s = check_strided(c.recv_blocks, c, "recv_blocks"); !s.ok()) return s;
    CollectiveSchedule plan;
    if (Status s = plan_for(kind, c.chunks, &plan); !s.ok()) return s;
    if (Status s = begin(kind, stream); !s.ok()) return s;

    const int64_t r = r_, B = c.block_bytes, part = B / c.chunks;
    const auto* send = static_cast<const uint8_t*>(c.send);
    auto* recv = static_cast<uint8_t*>(c.recv);
    const BlockRows from = BlockRows::of(c.send_blocks, B, c.chunks);
    const BlockRows into = BlockRows::of(c.recv_blocks, B, c.chunks);
    const int64_t send_rows = from.rows / c.chunks, recv_rows = into.rows / c.chunks;

    UNIEP_CUDA_OK(cudaEventRecord(start_event(), stream));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, start_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, done_event(), 0));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(copy_, start_event(), 0));
    for (const ChunkStep& st : plan.steps) {
      for (const Transfer& t : st.sends) {
        const int64_t dst = plan.chunk_dst(t.chunk), j = plan.chunk_part(t.chunk);
        if (Status s = push_rows(t.peer, push_slot(r) + j * part, from.at(send, dst, j, c.chunks),
                                 from.pitch, from.row_bytes, send_rows, arrived_word(r, j));
            !s.ok())
          return s;
      }
    }
    // Placement in plan order: the own block first (straight from send, no slot), then each
    // arrival once its signal is seen, from its slot into the caller's recv.
    for (const ChunkStep& st : plan.steps) {
      const int64_t src = plan.chunk_src(st.compute), j = plan.chunk_part(st.compute);
      uint8_t* to = const_cast<uint8_t*>(into.at(recv, src, j, c.chunks));
      if (src == r) {
        if (Status s = copy_own(to, into, from.at(send, r, j, c.chunks), from, j, part); !s.ok())
          return s;
        continue;
      }
      cuda::launch_coll_wait(words(layout_.arrived) + j, kMaxChunks, static_cast<int>(W_),
                             static_cast<int>(r), static_cast<int>(src), epoch_, timeout_ns(),
                             err_dev_, op_code(kind), wait_);
      UNIEP_CUDA_OK(cudaEventRecord(chunk_event(st.compute), wait_));
      UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, chunk_event(st.compute), 0));
      const uint8_t* slot = sym() + push_slot(src) + j * part;
      UNIEP_CUDA_OK(
          copy_2d(to, static_cast<size_t>(into.pitch), slot, static_cast<size_t>(into.row_bytes),
                  static_cast<size_t>(into.row_bytes), static_cast<size_t>(recv_rows), stream));
    }
    return finish(stream, Status::Ok());
  }

  // The GEMM + reduce-scatter as one persistent GEMM over its W x chunks parts (parts_gemm), in
  // the schedule's compute order (the peers' rows first, the own rows last), each part's row
  // tiles announced on a counter as they are stored: the communication stream waits on a
  // part's counters (the driver's stream wait: no SM) and pushes it at once, so the partials
  // leave while the GEMM goes on. The own parts are folded with the peers' partials, in the
  // reduce order, once the GEMM is done: the CPU executor's arithmetic on the GEMM's partials.
  Status reduce_scatter_one_gemm(const ReduceScatterCall& c, const CollectiveSchedule& plan,
                                 cudaStream_t stream) {
    const int64_t r = r_, m = c.rows_per_rank, mc = m / c.chunks;
    const int64_t rb = c.n * dtype_bytes(c.dtype), part = mc * rb;
    const auto* a = static_cast<const uint8_t*>(c.a);
    auto* scratch = static_cast<uint8_t*>(c.scratch);
    auto* out = static_cast<uint8_t*>(c.out);
    auto rows_of = [&](int64_t chunk) {
      return plan.chunk_block(chunk) * m + plan.chunk_part(chunk) * mc;
    };
    const auto count = static_cast<int64_t>(plan.steps.size());
    const int64_t tiles = cuda::part_gemm_row_tiles(mc);
    if (Status s = reserve_done(count * tiles); !s.ok()) return s;
    // The counters start from zero before the GEMM can signal them; the previous call's pushes
    // that waited on them are earlier on this same stream.
    UNIEP_CUDA_OK(cudaMemsetAsync(done_, 0, sizeof(uint32_t) * count * tiles, comm_));
    UNIEP_CUDA_OK(cudaEventRecord(zeroed_event(), comm_));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, zeroed_event(), 0));

    std::vector<cuda::GemmPart> parts(plan.steps.size());
    std::vector<int64_t> step_of(plan.steps.size());
    for (int64_t t = 0; t < count; ++t) {
      const int64_t chunk = plan.steps[t].compute;
      parts[t].a = a + rows_of(chunk) * c.a_row_bytes;
      parts[t].out = scratch + rows_of(chunk) * rb;
      step_of[chunk] = t;
    }
    if (Status s = c.parts_gemm.run(c.parts_gemm.ctx, parts.data(), count, mc, cuda::PartGate{},
                                    shares_device_ ? 1 : 0, done_, stream);
        !s.ok())
      return s;
    const uint32_t whole = cuda::part_gemm_tile_arrivals(c.n);
    for (const ChunkStep& st : plan.steps) {
      for (const Transfer& t : st.sends) {
        const int64_t at = step_of[t.chunk] * tiles;
        for (int64_t k = 0; k < tiles; ++k) {
          const CUresult e = wait_value_(comm_, reinterpret_cast<CUdeviceptr>(done_ + at + k),
                                         whole, CU_STREAM_WAIT_VALUE_GEQ);
          if (e != CUDA_SUCCESS)
            return {StatusCode::kInternal,
                    detail::str_cat("cuStreamWaitValue32 (a part's stored tiles) failed with "
                                    "CUresult ",
                                    static_cast<int>(e))};
        }
        const int64_t j = plan.chunk_part(t.chunk);
        if (Status s = push(t.peer, push_slot(r) + j * part, scratch + rows_of(t.chunk) * rb, part,
                            arrived_word(r, j));
            !s.ok())
          return s;
      }
    }
    UNIEP_CUDA_OK(cudaEventRecord(gemm_event(), stream));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(wait_, gemm_event(), 0));
    for (const ChunkStep& st : plan.steps) {
      if (plan.chunk_block(st.compute) != r) continue;
      const int64_t j = plan.chunk_part(st.compute);
      cuda::ReduceInputs in{};
      int n_in = 0;
      for (const Transfer& f : st.fold_waits) in.in[n_in++] = sym() + push_slot(f.peer) + j * part;
      in.in[n_in++] = scratch + rows_of(st.compute) * rb;
      cuda::launch_coll_wait(words(layout_.arrived) + j, kMaxChunks, static_cast<int>(W_),
                             static_cast<int>(r), -1, epoch_, timeout_ns(), err_dev_,
                             op_code(CollectiveKind::kMatmulReduceScatter), wait_);
      cuda::launch_coll_reduce(c.dtype, in, n_in, out + j * part, mc * c.n, sm_count_, wait_);
      UNIEP_CUDA_OK(cudaGetLastError());
    }
    UNIEP_CUDA_OK(cudaEventRecord(folded_event(), wait_));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, folded_event(), 0));
    return Status::Ok();
  }

  // done_ holds at least `counters` uint32 (grown where short: cudaFree and cudaMalloc wait for
  // the device, so no call still reads the old one).
  Status reserve_done(int64_t counters) {
    if (counters <= done_counters_) return Status::Ok();
    if (done_ != nullptr) UNIEP_CUDA_OK(cudaFree(done_));
    done_ = nullptr;
    done_counters_ = 0;
    UNIEP_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&done_), sizeof(uint32_t) * counters));
    done_counters_ = counters;
    return Status::Ok();
  }

  Status check_device_errors(bool synchronize) override {
    if (synchronize) {
      UNIEP_CUDA_OK(cudaStreamSynchronize(comm_));
      UNIEP_CUDA_OK(cudaDeviceSynchronize());
    }
    return take_device_error();
  }

 private:
  static Status bad(const std::string& message) { return {StatusCode::kInvalidArgument, message}; }

  Status check_rows(int64_t rows, int64_t chunks, const char* name) const {
    if (chunks < 1 || chunks > kMaxChunks)
      return bad(detail::str_cat("chunks must be in [1, ", kMaxChunks, "], got ", chunks));
    if (rows < 1 || rows % chunks != 0)
      return bad(detail::str_cat(name, " (", rows, ") must be >= 1 and divisible by chunks (",
                                 chunks, ")"));
    return Status::Ok();
  }

  // A strided side of an all-to-all: its rows hold block_bytes and split into whole chunks,
  // and its blocks do not overlap their rows.
  static Status check_strided(const StridedBlocks& b, const AllToAllCall& c, const char* name) {
    if (b.rows == 0) return Status::Ok();
    if (b.rows < 0 || b.row_bytes < 0 || b.rows * b.row_bytes != c.block_bytes)
      return bad(detail::str_cat(name, ": rows (", b.rows, ") * row_bytes (", b.row_bytes,
                                 ") must equal block_bytes (", c.block_bytes, ")"));
    if (b.rows % c.chunks != 0)
      return bad(detail::str_cat(name, ": rows (", b.rows, ") must be divisible by chunks (",
                                 c.chunks, ")"));
    if (b.block_stride < b.row_bytes || b.pitch < b.row_bytes)
      return bad(detail::str_cat(name, ": block_stride (", b.block_stride, ") and pitch (", b.pitch,
                                 ") must be >= row_bytes (", b.row_bytes, ")"));
    return Status::Ok();
  }

  // The own block's chunk j from send to recv on the local copy stream (beside the pushes): one
  // 2-D copy where either side is contiguous, else through its packed form in this rank's own
  // slot, which no peer writes (two strided sides, e.g. a leading batch dim, differ in rows).
  Status copy_own(uint8_t* to, const BlockRows& into, const uint8_t* from, const BlockRows& src,
                  int64_t j, int64_t part) {
    if (part == 0) return Status::Ok();
    const auto u = [](int64_t v) { return static_cast<size_t>(v); };
    const int64_t rows_from = part / src.row_bytes, rows_to = part / into.row_bytes;
    if (into.pitch == into.row_bytes) {
      UNIEP_CUDA_OK(
          copy_2d(to, u(src.row_bytes), from, u(src.pitch), u(src.row_bytes), u(rows_from), copy_));
    } else if (src.pitch == src.row_bytes) {
      UNIEP_CUDA_OK(copy_2d(to, u(into.pitch), from, u(into.row_bytes), u(into.row_bytes),
                            u(rows_to), copy_));
    } else {
      uint8_t* staged = sym() + push_slot(r_) + j * part;
      UNIEP_CUDA_OK(copy_2d(staged, u(src.row_bytes), from, u(src.pitch), u(src.row_bytes),
                            u(rows_from), copy_));
      UNIEP_CUDA_OK(copy_2d(to, u(into.pitch), staged, u(into.row_bytes), u(into.row_bytes),
                            u(rows_to), copy_));
    }
    return Status::Ok();
  }

  Status check_block(int64_t bytes, const char* what) const {
    if (bytes > cfg_.max_block_bytes)
      return {StatusCode::kCapacityExceeded,
              detail::str_cat("this call moves blocks of ", bytes, " bytes (", what,
                              ") but the collectives runtime was created with max_block_bytes ",
                              cfg_.max_block_bytes,
                              "; re-create it (uniep.collectives.init_cuda) with a larger one")};
    return Status::Ok();
  }

  Status enable_peer_access() {
    int self = 0;
    UNIEP_CUDA_OK(cudaGetDevice(&self));
    for (int64_t p = 0; p < cfg_.world_size; ++p) {
      if (p == cfg_.rank) continue;
      cudaPointerAttributes attr{};
      if (cudaPointerGetAttributes(&attr, peer_[p]) != cudaSuccess || attr.device < 0) {
        (void)cudaGetLastError();
        continue;  // not a device this process sees: the copy path decides
      }
      if (attr.device == self) {
        shares_device_ = true;  // a rank on this same GPU (tests of several ranks on one GPU)
        continue;
      }
      int can = 0;
      UNIEP_CUDA_OK(cudaDeviceCanAccessPeer(&can, self, attr.device));
      if (!can) continue;
      const cudaError_t e = cudaDeviceEnablePeerAccess(attr.device, 0);
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
        return {StatusCode::kInternal, detail::str_cat("cudaDeviceEnablePeerAccess(", attr.device,
                                                       ") failed: ", cudaGetErrorString(e))};
      (void)cudaGetLastError();
    }
    return Status::Ok();
  }

  // The schedule throws on bad arguments; they were checked, but this API returns a Status.
  Status plan_for(CollectiveKind kind, int64_t chunks, CollectiveSchedule* plan) const {
    try {
      *plan = make_schedule(kind, W_, r_, chunks, PeerOrder::kDirect);
    } catch (const Error& e) {
      return {e.code(), e.what()};
    }
    return Status::Ok();
  }

  // Common prologue: a pending device error fails this call (a peer is gone; later waits would
  // only time out again), and capture is refused (the epochs would be frozen into the graph).
  Status begin(CollectiveKind kind, cudaStream_t stream) {
    if (Status s = runtime::refuse_capture(stream, collective_kind_name(kind),
                                           " on CUDA cannot be captured in a CUDA graph: each "
                                           "call's signals carry a fresh epoch from the host");
        !s.ok())
      return s;
    if (Status s = take_device_error(); !s.ok()) return s;
    ++epoch_;
    return Status::Ok();
  }

  // The caller's stream joins the communication stream, so everything the call wrote (and read
  // from the caller's tensors) is ordered before whatever the caller enqueues next.
  Status finish(cudaStream_t stream, Status status) {
    UNIEP_CUDA_OK(cudaGetLastError());
    UNIEP_CUDA_OK(cudaEventRecord(copied_event(), copy_));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(comm_, copied_event(), 0));
    UNIEP_CUDA_OK(cudaEventRecord(end_event(), comm_));
    UNIEP_CUDA_OK(cudaStreamWaitEvent(stream, end_event(), 0));
    UNIEP_CUDA_OK(cudaEventRecord(done_event(), stream));
    return status;
  }

  // Copies `bytes` from `src` to offset `at` of `peer`'s allocation on the communication
  // stream, then sets this rank's arrival word `word` there to the current epoch.
  Status push(int64_t peer, size_t at, const void* src, int64_t bytes, size_t word) {
    UNIEP_CUDA_OK(copy_async(group_peer_[peer] + at, src, static_cast<size_t>(bytes), comm_));
    return signal(peer, word, comm_);
  }

  // The push of `rows` rows of `width` bytes, one `pitch` apart at src, packed at `at`.
  Status push_rows(int64_t peer, size_t at, const void* src, int64_t pitch, int64_t width,
                   int64_t rows, size_t word) {
    const auto w = static_cast<size_t>(width);
    UNIEP_CUDA_OK(copy_2d(group_peer_[peer] + at, w, src, static_cast<size_t>(pitch), w,
                          static_cast<size_t>(rows), comm_));
    return signal(peer, word, comm_);
  }

  // Sets this rank's arrival word `word` on `peer` to the current epoch after the stream's
  // earlier copies: the driver's stream write (its default flags fence the stream's earlier
  // writes first, at system scope), else a one-thread kernel (fence, then a release store).
  Status signal(int64_t peer, size_t word, cudaStream_t s) {
    auto* target = reinterpret_cast<uint64_t*>(group_peer_[peer] + word);
    if (write_value_ != nullptr) {
      const CUresult e = write_value_(s, reinterpret_cast<CUdeviceptr>(target), epoch_,
                                      CU_STREAM_WRITE_VALUE_DEFAULT);
      if (e == CUDA_SUCCESS) return Status::Ok();
      if (e != CUDA_ERROR_NOT_SUPPORTED)
        return {StatusCode::kInternal,
                detail::str_cat("cuStreamWriteValue64 (arrival signal to rank ", peer,
                                ") failed with CUresult ", static_cast<int>(e))};
      write_value_ = nullptr;  // this device has no 64-bit stream writes: the kernel from now on
    }
    cuda::launch_coll_signal(target, epoch_, s);
    UNIEP_CUDA_OK(cudaGetLastError());
    return Status::Ok();
  }

  // A gated GEMM's timeout (PartsGemm): its part index names the owner through the schedule of
  // the call whose epoch it records (the chunks of the last kGatedHistory gated calls are kept).
  Status take_gate_timeout() {
    const volatile cuda::GateTimeout& t = *gate_host_;
    if (t.flag == 0) return Status::Ok();
    const int64_t part = t.expert;
    const int64_t chunks = std::max<int64_t>(1, gated_chunks_[t.need % kGatedHistory]);
    const uint32_t have = t.have, need = t.need;
    *gate_host_ = cuda::GateTimeout{};
    const int64_t owner = (r_ + part / chunks) % W_;
    return {StatusCode::kTimeout,
            detail::str_cat("uniep all-gather + GEMM on rank ", r_, " timed out after ",
                            cfg_.timeout_s, " s waiting for rank ", owner, "'s part ",
                            part % chunks, " (signal ", have, ", expected ", need,
                            "); did every rank of the group make the same calls?", group_note())};
  }

  Status take_device_error() {
    if (Status s = take_gate_timeout(); !s.ok()) {
      (void)runtime::take_device_error(err_host_,
                                       [](const volatile DeviceError&) { return Status::Ok(); });
      return s;
    }
    return runtime::take_device_error(err_host_, [&](const volatile DeviceError& e) {
      const char* what = "collective";
      if (e.op >= cuda::kCollOpBase)
        what = collective_kind_name(static_cast<CollectiveKind>(e.op - cuda::kCollOpBase));
      const std::string hint =
          detail::str_cat("did every rank of the group make the same calls?", group_note());
      return runtime::wait_timeout(what, r_, cfg_.timeout_s, e, hint.c_str());
    });
  }

  // The NVSHMEM PE of group rank g.
  int64_t world_rank(int64_t g) const { return cfg_.members.empty() ? g : cfg_.members[g]; }
  // For a sub-group's errors, whose ranks are the group's: which world ranks they are.
  std::string group_note() const {
    if (cfg_.members.empty()) return "";
    std::string ranks;
    for (int64_t m : cfg_.members) ranks += (ranks.empty() ? "" : ", ") + std::to_string(m);
    return detail::str_cat(" (ranks of the group of world ranks ", ranks, ")");
  }

  uint8_t* sym() const { return heap_.base(); }
  const uint64_t* words(size_t offset) const {
    return reinterpret_cast<const uint64_t*>(sym() + offset);
  }
  // src's slot in the set of the current call's epoch parity (see Carve).
  size_t push_slot(int64_t src) const {
    const auto set = static_cast<int64_t>(epoch_ & 1);
    return layout_.push +
           static_cast<size_t>(set * W_ + src) * static_cast<size_t>(cfg_.max_block_bytes);
  }
  size_t arrived_word(int64_t src, int64_t part) const {
    return layout_.arrived + sizeof(uint64_t) * static_cast<size_t>(src * kMaxChunks + part);
  }
  static uint32_t op_code(CollectiveKind kind) {
    return cuda::kCollOpBase + static_cast<uint32_t>(kind);
  }
  uint64_t timeout_ns() const { return static_cast<uint64_t>(cfg_.timeout_s * 1e9); }
  cudaEvent_t start_event() const { return events_[0]; }
  cudaEvent_t end_event() const { return events_[1]; }
  cudaEvent_t folded_event() const { return events_[2]; }
  cudaEvent_t copied_event() const { return events_[3]; }
  // The previous call, complete on its caller's stream (its GEMMs read the slots there).
  cudaEvent_t done_event() const { return events_[4]; }
  // reduce_scatter_one_gemm: its counters zeroed; its GEMM done.
  cudaEvent_t zeroed_event() const { return events_[5]; }
  cudaEvent_t gemm_event() const { return events_[6]; }
  // One per chunk id; the all-to-all's ids run to W*W*c but only W*c of them reach events.
  cudaEvent_t chunk_event(int64_t chunk) const {
    return events_[kFixedEvents + chunk % (kMaxRanks * kMaxChunks)];
  }

  Config cfg_;
  Carve layout_;
  runtime::SymmetricHeap heap_;
  uint8_t* peer_[kMaxRanks] = {};        // by world rank (NVSHMEM PE)
  int64_t W_ = 1, r_ = 0;                // the calls' group: its size, this rank in it
  uint8_t* group_peer_[kMaxRanks] = {};  // by group rank
  static constexpr int kFixedEvents = 7;
  cudaStream_t comm_ = nullptr, wait_ = nullptr, copy_ = nullptr;
  StreamWriteValue64 write_value_ = nullptr;
  StreamWaitValue32 wait_value_ = nullptr;
  uint32_t* done_ = nullptr;  // reduce_scatter_one_gemm's counters
  int64_t done_counters_ = 0;
  cudaEvent_t events_[kFixedEvents + kMaxRanks * kMaxChunks] = {};
  DeviceError *err_host_ = nullptr, *err_dev_ = nullptr;
  cuda::GateTimeout *gate_host_ = nullptr, *gate_dev_ = nullptr;  // the gated GEMM's record
  static constexpr uint64_t kGatedHistory = 64;
  int64_t gated_chunks_[kGatedHistory] = {};
  int sm_count_ = 1;
  bool shares_device_ = false;  // some peer's memory is on this GPU
  uint64_t epoch_ = 0;
};

}  // namespace

int64_t Config::group_size() const {
  return members.empty() ? world_size : static_cast<int64_t>(members.size());
}

int64_t Config::group_rank() const {
  if (members.empty()) return rank;
  for (size_t g = 0; g < members.size(); ++g)
    if (members[g] == rank) return static_cast<int64_t>(g);
  return -1;
}

Status Config::validate() const {
  auto bad = [](const std::string& m) { return Status{StatusCode::kInvalidArgument, m}; };
  if (world_size < 1 || world_size > kMaxRanks)
    return bad(detail::str_cat("world_size must be in [1, ", kMaxRanks, "], got ", world_size));
  if (rank < 0 || rank >= world_size)
    return bad(detail::str_cat("rank must be in [0, ", world_size, "), got ", rank));
  for (size_t g = 0; g < members.size(); ++g) {
    if (members[g] < 0 || members[g] >= world_size || (g > 0 && members[g] <= members[g - 1]))
      return bad(detail::str_cat("members must be distinct world ranks in [0, ", world_size,
                                 ") in ascending order, got ", members[g], " at position ", g));
  }
  if (group_rank() < 0) return bad(detail::str_cat("members must include this rank (", rank, ")"));
  if (max_block_bytes < 1)
    return bad(detail::str_cat("max_block_bytes must be >= 1, got ", max_block_bytes));
  if (!(timeout_s > 0)) return bad(detail::str_cat("timeout_s must be > 0, got ", timeout_s));
  return Status::Ok();
}

size_t symmetric_heap_bytes(const Config& config) {
  return carve(config).total;
}

Status Runtime::create(const Config& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<Runtime>* runtime) {
  return ::uniep::runtime::create_runtime<RuntimeImpl>(config, unique_id, runtime);
}

}  // namespace uniep::coll
