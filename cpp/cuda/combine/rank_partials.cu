// combine=rank_partials: one bf16 row per (token, expert rank) crosses the wire instead of one
// per (token, k). The expert rank sums each receive slot's rows (its own k's of the token,
// ascending, fp32, routing weights applied, one rounding to bf16); the token's rank sums the
// partials in ascending rank order in fp32. The rows are fp32 (moe_forward's second product as
// accumulated: the partial's rounding then replaces the rows' own, and the layer keeps per_k's
// accuracy) or bf16 (a caller's). Slot-indexed at both ends, so the bits never depend on which
// block carried a row or when it arrived; the CPU executor sums in the same order.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common/combine_reduce.cuh"
#include "cuda/common/signal_wait.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;       // bf16 columns per 16-byte vector
constexpr int kSegments = 4;  // warps sharing one row: a few slots per warp over the whole GPU
constexpr int kUnroll = 4;    // vectors of a row in flight per lane
constexpr int kPartialBlocksPerSm = 3;  // all resident: one wave, the warps stride the items

__device__ __forceinline__ uint64_t tag(uint32_t epoch, int64_t row) {
  return static_cast<uint64_t>(epoch) << 32 | static_cast<uint32_t>(row);
}

// y's rows may come in any order (row_target says where each goes), so the expert side first
// inverts row_target: entry (source, token, k) -> row, tagged with the round so that a stale
// entry of an earlier round reads as missing, never as a row.
__global__ void index_rows_kernel(EpDims d, CombineArgs a, RankPartialsArgs p) {
  const int64_t limit = d.world_size * d.max_tokens * d.top_k;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < a.rows;
       r += stride) {
    const int64_t target = a.row_target[r];
    if (target < 0 || target >= limit) {
      report_error(a.err, WaitOp::kCombineTarget, static_cast<int>(d.rank), r, target);
      continue;
    }
    const auto old = atomicExch(reinterpret_cast<unsigned long long*>(p.row_of_target + target),
                                static_cast<unsigned long long>(tag(p.epoch, r)));
    if (old >> 32 == p.epoch)
      report_error(a.err, WaitOp::kCombineTarget, static_cast<int>(d.rank), r, target);
  }
}

// The whole GPU, one warp per (receive slot, segment of its row): the weighted sum of the slot's
// rows, stored straight into row (token, us) of the source's combine buffer (ours locally, a
// peer's over NVLink). Reading the expert rows (one per (token, k), about K / W times the bytes
// sent) is the bulk of the work, too much for a few SMs; the stores ride along, as the
// MegaKernel's GEMM epilogue will store its outputs. Then one signal per peer (signal_wait.cuh).
// YF32: y's rows are fp32 (two 16-byte loads per 8 columns) instead of bf16 (one).
template <bool YF32>
__global__ void __launch_bounds__(kThreads, kPartialBlocksPerSm)
    partials_kernel(SymmetricView sym, EpDims d, CombineArgs a, RankPartialsArgs p) {
  const int64_t W = d.world_size, K = d.top_k, me = d.rank, meta_len = 1 + K;
  const int64_t row_bytes = d.hidden * 2;  // a partial's; y's rows are twice that with YF32
  const int64_t first = me * d.experts_per_rank, last = first + d.experts_per_rank;
  const uint64_t deadline = global_timer_ns() + a.timeout_ns;
  const int lane = threadIdx.x % 32;
  unsigned long long* sent = block_send_counts(W);

  // The items interleave the sources (item i: source (me + i / kSegments) % W), so the stores
  // to every peer and the local ones run side by side all through the kernel. In slot order
  // (slots are grouped by source) each rank stored over NVLink only while it walked a peer's
  // slots, and its own slots left the link idle: at EP2, half the kernel.
  int64_t most = 0;  // slots of the source that sent the most
  for (int64_t s = 0; s < W; ++s)
    most = max(most, a.plan.recv_offsets[s + 1] - a.plan.recv_offsets[s]);
  const int64_t items = most * W * kSegments;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t item = warp; item < items; item += num_warps) {
    const int seg = static_cast<int>(item % kSegments);
    const int64_t src = (me + item / kSegments) % W, q = item / kSegments / W;
    if (q >= a.plan.recv_offsets[src + 1] - a.plan.recv_offsets[src]) continue;
    const int64_t n = a.plan.recv_offsets[src] + q;
    const int64_t* meta = sym.recv_meta + n * meta_len;
    const int64_t token = meta[0];
    // Lane k holds choice k's row and weight when the expert is ours; a ballot lists them.
    int64_t row = 0;
    float weight = 0.f;
    bool mine = false;
    if (lane < K) {
      const int64_t expert = meta[1 + lane];
      if (expert >= first && expert < last) {
        const uint64_t entry = p.row_of_target[(src * d.max_tokens + token) * K + lane];
        if (entry >> 32 == p.epoch) {
          mine = true;
          row = static_cast<uint32_t>(entry);
          weight = sym.recv_weights[n * K + lane];
        } else if (seg == 0) {
          report_error(a.err, WaitOp::kCombineMissing, static_cast<int>(src), n, lane);
        }
      }
    }
    const unsigned ks = __ballot_sync(0xffffffffu, mine);
    const RowSegment part = row_segment(row_bytes, kSegments, seg);
    uint8_t* local = sym.combine + (token * W + me) * row_bytes + part.offset;
    // Every peer is mapped (checked on the host).
    auto* dst =
        reinterpret_cast<int4*>(src == me ? local : nvshmem_ptr(local, static_cast<int>(src)));
    const int64_t vecs = part.bytes / 16, col = part.offset / 16;
    // Every lane runs every pass, also those with no vector in it: the shuffles below name the
    // whole warp, and a lane that left the loop early (a segment of fewer than 32 vectors, or a
    // last pass that covers part of the lanes) never reached them, so the warp waited forever.
    for (int64_t base = 0; base < vecs; base += 32 * kUnroll) {
      const int64_t v0 = base + lane;
      float acc[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < kVec; ++j) acc[u][j] = 0.f;
      for (unsigned left = ks; left != 0; left &= left - 1) {
        const int k = __ffs(static_cast<int>(left)) - 1;  // ascending k
        const int64_t r = __shfl_sync(0xffffffffu, row, k);
        const float w = __shfl_sync(0xffffffffu, weight, k);
        if constexpr (YF32) {
          // Vector v of the partial (8 columns) is vectors 2v and 2v + 1 of the fp32 row.
          const int4* y = reinterpret_cast<const int4*>(a.y + r * 2 * row_bytes) + 2 * col;
          int4 raw[kUnroll][2];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + 32 * u;
            raw[u][0] = v < vecs ? load_streaming(y + 2 * v) : int4{0, 0, 0, 0};
            raw[u][1] = v < vecs ? load_streaming(y + 2 * v + 1) : int4{0, 0, 0, 0};
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) accumulate_f32x8(acc[u], raw[u][0], raw[u][1], w);
        } else {
          const int4* y = reinterpret_cast<const int4*>(a.y + r * row_bytes) + col;
          int4 raw[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u)
            raw[u] = v0 + 32 * u < vecs ? load_streaming(y + v0 + 32 * u) : int4{0, 0, 0, 0};
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) accumulate_bf16x8(acc[u], raw[u], w);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + 32 * u >= vecs) break;
        dst[v0 + 32 * u] = round_bf16x8(acc[u]);
      }
    }
    if (lane == 0 && src != me) atomicAdd(&sent[src], 1ull);
  }
  // Our own tokens' partials are in place (the reduction follows on this stream); each peer
  // answers with kSegments pieces per token we sent it.
  const auto owed = [&](int64_t s) { return s == me ? int64_t{0} : a.plan.sent_to[s] * kSegments; };
  signal_then_wait(sym.signals + kCombineSignal * W, sent, sym.tally + kCombineSignal, W, me, owed,
                   deadline, a.err, WaitOp::kCombine);
}

// Home: out[t] = sum of the token's partials over the ranks it went to, ascending, fp32. The
// expert ranks applied the weights the dispatch carried, so the caller's must be those. Every
// rank's vector is loaded before the first is added: one load in flight per thread left the
// kernel at about 60% of HBM bandwidth. kMaxW bounds the unrolled loads (registers: one array
// for the largest group would cap the occupancy instead); 0: one load at a time, for W > 8.
template <int kMaxW>
__global__ void partials_reduce_kernel(SymmetricView sym, EpDims d, CombineArgs a,
                                       RankPartialsArgs p) {
  const int64_t W = d.world_size, K = d.top_k, row_bytes = d.hidden * 2, vecs = d.hidden / kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.tokens * vecs;
       i += stride) {
    const int64_t t = i / vecs, v = i % vecs;
    if (v == 0) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t at = t * K + k;
        if (a.topk_idx[at] >= 0 &&
            __float_as_uint(a.topk_weights[at]) != __float_as_uint(p.dispatched_weights[at]))
          report_error(a.err, WaitOp::kCombineWeights, static_cast<int>(d.rank), t, k);
      }
    }
    const auto partial = [&](int64_t r) {
      return load_streaming(reinterpret_cast<const int4*>(sym.combine + (t * W + r) * row_bytes) +
                            v);
    };
    float acc[kVec] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Weight 1: the product is exact, so this is the plain fp32 sum of the partials.
    if constexpr (kMaxW > 0) {
      int4 raw[kMaxW];
      bool in[kMaxW];
#pragma unroll
      for (int r = 0; r < kMaxW; ++r) {
        in[r] = r < W && p.token_in_rank[t * W + r];
        if (in[r]) raw[r] = partial(r);
      }
#pragma unroll
      for (int r = 0; r < kMaxW; ++r)
        if (in[r]) accumulate_bf16x8(acc, raw[r], 1.0f);
    } else {
      for (int64_t r = 0; r < W; ++r)
        if (p.token_in_rank[t * W + r]) accumulate_bf16x8(acc, partial(r), 1.0f);
    }
    reinterpret_cast<int4*>(a.out + t * row_bytes)[v] = round_bf16x8(acc);
  }
}

template <int kMaxW>
void launch_partials_reduce(const SymmetricView& sym, const EpDims& d, const CombineArgs& a,
                            const RankPartialsArgs& p, int blocks, cudaStream_t stream) {
  partials_reduce_kernel<kMaxW><<<blocks, kThreads, 0, stream>>>(sym, d, a, p);
}

}  // namespace

void launch_combine_rank_partials(const SymmetricView& sym, const EpDims& d, const CombineArgs& a,
                                  const RankPartialsArgs& p, int num_sms, cudaStream_t stream) {
  const int blocks = 4 * num_sms;
  if (a.rows > 0) index_rows_kernel<<<blocks, kThreads, 0, stream>>>(d, a, p);
  if (a.y_f32)
    partials_kernel<true><<<kPartialBlocksPerSm * num_sms, kThreads, 0, stream>>>(sym, d, a, p);
  else
    partials_kernel<false><<<kPartialBlocksPerSm * num_sms, kThreads, 0, stream>>>(sym, d, a, p);
  if (a.tokens == 0) return;
  if (d.world_size <= 2)
    launch_partials_reduce<2>(sym, d, a, p, blocks, stream);
  else if (d.world_size <= 4)
    launch_partials_reduce<4>(sym, d, a, p, blocks, stream);
  else if (d.world_size <= 8)
    launch_partials_reduce<8>(sym, d, a, p, blocks, stream);
  else
    launch_partials_reduce<0>(sym, d, a, p, blocks, stream);
}

}  // namespace uniep::cuda
