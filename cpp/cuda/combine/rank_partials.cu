// combine=rank_partials: one bf16 row per (token, expert rank) crosses the wire instead of one
// per (token, k). The expert rank sums each receive slot's rows (its own k's of the token,
// ascending, fp32, routing weights applied, one rounding to bf16); the token's rank sums the
// partials in ascending rank order in fp32. Slot-indexed at both ends, so the bits never depend
// on which block carried a row or when it arrived; the CPU executor sums in the same order.
#include <cuda_bf16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common/signal_wait.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kVec = 8;  // bf16 columns per 16-byte vector

__device__ __forceinline__ int64_t source_of(const PlanCounts& plan, int64_t world, int64_t slot) {
  int64_t s = 0;
  while (s + 1 < world && slot >= plan.recv_offsets[s + 1]) ++s;
  return s;
}

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

// One thread per (receive slot, 8 columns): the weighted sum of the slot's rows. Our own
// tokens' partials go straight to our combine buffer; the others' to staging for the transfer.
__global__ void partials_kernel(SymmetricView sym, EpDims d, CombineArgs a, RankPartialsArgs p) {
  const int64_t W = d.world_size, K = d.top_k, me = d.rank, meta_len = 1 + K;
  const int64_t row_bytes = d.hidden * 2, vecs = d.hidden / kVec;
  const int64_t first = me * d.experts_per_rank, last = first + d.experts_per_rank;
  const int64_t N = a.plan.recv_offsets[W];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * vecs;
       i += stride) {
    const int64_t n = i / vecs, v = i % vecs;
    const int64_t src = source_of(a.plan, W, n);
    const int64_t* meta = sym.recv_meta + n * meta_len;
    const int64_t token = meta[0];
    float acc[kVec] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < K; ++k) {
      const int64_t expert = meta[1 + k];
      if (expert < first || expert >= last) continue;
      const uint64_t entry = p.row_of_target[(src * d.max_tokens + token) * K + k];
      if (entry >> 32 != p.epoch) {
        if (v == 0) report_error(a.err, WaitOp::kCombineMissing, static_cast<int>(src), n, k);
        continue;
      }
      const float w = sym.recv_weights[n * K + k];
      const int64_t row = static_cast<uint32_t>(entry);
      const int4 raw = load_streaming(reinterpret_cast<const int4*>(a.y + row * row_bytes) + v);
      const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        acc[j] = __fadd_rn(acc[j], __fmul_rn(w, __bfloat162float(y[j])));
    }
    int4 packed;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = __float2bfloat16_rn(acc[j]);
    uint8_t* dst =
        src == me ? sym.combine + (token * W + me) * row_bytes : p.staging + n * row_bytes;
    reinterpret_cast<int4*>(dst)[v] = packed;
  }
}

// The communication SM budget: one warp per peer's receive slot copies its staged partial into
// row (token, us) of the source's combine buffer over NVLink.
__global__ void __launch_bounds__(kThreads, 1)
    partials_send_kernel(SymmetricView sym, EpDims d, CombineArgs a, RankPartialsArgs p) {
  const int64_t W = d.world_size, me = d.rank, meta_len = 1 + d.top_k;
  const int64_t row_bytes = d.hidden * 2;
  const uint64_t deadline = global_timer_ns() + a.timeout_ns;
  const int lane = threadIdx.x % 32;
  unsigned long long* sent = block_send_counts(W);

  // Our own slots were written in place by partials_kernel.
  const int64_t self_begin = a.plan.recv_offsets[me];
  const int64_t self_slots = a.plan.recv_offsets[me + 1] - self_begin;
  const int64_t remote = a.plan.recv_offsets[W] - self_slots;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t j = warp; j < remote; j += num_warps) {
    const int64_t n = j < self_begin ? j : j + self_slots;
    const int64_t src = source_of(a.plan, W, n);
    const int64_t token = sym.recv_meta[n * meta_len];
    // Every peer is mapped (checked on the host): staging is not symmetric, so no NVSHMEM put.
    auto* peer = static_cast<uint8_t*>(
        nvshmem_ptr(sym.combine + (token * W + me) * row_bytes, static_cast<int>(src)));
    warp_copy<8>(peer, p.staging + n * row_bytes, row_bytes, lane);
    if (lane == 0) atomicAdd(&sent[src], 1ull);
  }
  const auto owed = [&](int64_t s) { return s == me ? int64_t{0} : a.plan.sent_to[s]; };
  signal_then_wait(sym.signals + kCombineSignal * W, sent, sym.tally + kCombineSignal, W, me, owed,
                   deadline, a.err, WaitOp::kCombine);
}

// Home: out[t] = sum of the token's partials over the ranks it went to, ascending, fp32. The
// expert ranks applied the weights the dispatch carried, so the caller's must be those.
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
    float acc[kVec] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t r = 0; r < W; ++r) {
      if (!p.token_in_rank[t * W + r]) continue;
      const int4 raw =
          load_streaming(reinterpret_cast<const int4*>(sym.combine + (t * W + r) * row_bytes) + v);
      const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = __fadd_rn(acc[j], __bfloat162float(y[j]));
    }
    int4 packed;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = __float2bfloat16_rn(acc[j]);
    reinterpret_cast<int4*>(a.out + t * row_bytes)[v] = packed;
  }
}

}  // namespace

void launch_combine_rank_partials(const SymmetricView& sym, const EpDims& d, const CombineArgs& a,
                                  const RankPartialsArgs& p, int blocks, int reduce_blocks,
                                  cudaStream_t stream) {
  if (a.rows > 0) index_rows_kernel<<<reduce_blocks, 256, 0, stream>>>(d, a, p);
  partials_kernel<<<reduce_blocks, 256, 0, stream>>>(sym, d, a, p);
  partials_send_kernel<<<blocks, kThreads, 0, stream>>>(sym, d, a, p);
  if (a.tokens > 0) partials_reduce_kernel<<<reduce_blocks, 256, 0, stream>>>(sym, d, a, p);
}

}  // namespace uniep::cuda
