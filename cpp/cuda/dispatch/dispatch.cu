// Dispatch: each warp takes tokens and puts the row, its source index and its routing into the
// token's receive slot on every destination rank (once per rank, however many of its experts live
// there). Slots come from the plan, so where a row lands never depends on which warp, block or
// SM budget carried it, nor on arrival order.
//
// Completion: each block counts the rows it sent to each rank and, after nvshmem_quiet (its puts
// are visible at the target), adds that count to the target's signal for this source. Block 0
// waits until each source's signal reaches the count agreed in notify; a second kernel, on the
// whole GPU, then copies the slots out. Our own rows never cross NVLink: a third kernel writes
// them beside the transfer.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include "cuda/common/fp8_block.cuh"
#include "cuda/common/signal_wait.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// One warp casts a bf16 row to e4m3 with a scale per 128 columns (common/fp8_block.cuh: scale =
// amax / 448, q = RNE(x * (448 / amax)) saturated) and writes the receive-buffer format (H bytes,
// then the fp32 scales) to every destination: the row is read and cast once. Exactly the CPU
// executor's encoding, so the bytes can be compared. scale_dsts[d]: where destination d's scales go
// (right after its row in a receive slot; the caller's recv_scales for a row written straight out).
// Each lane takes 16 columns (two 16-byte loads, one 16-byte store per destination), so eight
// lanes share a scale block: 4-byte stores over NVLink, four lanes per block, made the cast
// slower than a bf16 copy of twice the bytes.
constexpr int kCastCols = 16;                      // columns per lane and step
constexpr int kCastLanes = kFp8Block / kCastCols;  // lanes per scale block
constexpr int kCastStep = 32 * kCastCols;          // columns per warp and step
__device__ __forceinline__ void warp_cast_fp8(uint8_t* const* dsts, float* const* scale_dsts,
                                              int num_dsts, const __nv_bfloat16* x, int64_t hidden,
                                              int lane) {
  constexpr int kUnroll = 2;  // steps in flight per lane
  for (int64_t c0 = 0; c0 < hidden; c0 += kCastStep * kUnroll) {
    int4 raw[kUnroll][2];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t col = c0 + u * kCastStep + lane * kCastCols;
      if (col < hidden) {
        raw[u][0] = load_streaming(reinterpret_cast<const int4*>(x + col));
        raw[u][1] = load_streaming(reinterpret_cast<const int4*>(x + col) + 1);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t col = c0 + u * kCastStep + lane * kCastCols;
      // hidden is a multiple of 128, so a scale block's eight lanes are all in or all out.
      const bool in = col < hidden;
      const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(raw[u]);
      float v[kCastCols];
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kCastCols; ++j) {
        v[j] = in ? __bfloat162float(h[j]) : 0.0f;
        amax = fmaxf(amax, fabsf(v[j]));
      }
      amax = block_amax<kCastLanes>(amax);
      if (!in) continue;
      const float scale = e4m3_scale(amax);
      int4 packed;
      encode_e4m3(v, amax, reinterpret_cast<uint8_t*>(&packed));
      for (int d = 0; d < num_dsts; ++d) {
        *reinterpret_cast<int4*>(dsts[d] + col) = packed;
        if (lane % kCastLanes == 0) scale_dsts[d][col / kFp8Block] = scale;
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1)
    transfer_kernel(SymmetricView sym, EpDims d, DispatchArgs a) {
  // A failed round (notify or reuse barrier): the peers have stopped, so nothing is sent and
  // nothing awaited.
  if (*a.round_ok == 0) return;
  const int64_t W = d.world_size, K = d.top_k, me = d.rank, meta_len = 1 + K;
  const uint64_t deadline = global_timer_ns() + a.timeout_ns;
  const int lane = threadIdx.x % 32;
  unsigned long long* sent = block_send_counts(W);

  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarps;
  constexpr int kMaxDsts = 16;  // mapped destinations served by one read of the row
  for (int64_t t = warp; t < a.tokens; t += num_warps) {
    const uint8_t* x_row = a.x + t * a.row_bytes;
    for (int64_t d0 = 0; d0 < W; d0 += kMaxDsts) {
      uint8_t* mapped[kMaxDsts];
      float* mapped_scales[kMaxDsts];
      int num_mapped = 0;
      for (int64_t dst = d0; dst < W && dst < d0 + kMaxDsts; ++dst) {
        const int64_t index = a.send_index[t * W + dst];
        if (index < 0) continue;
        const int64_t slot = a.plan.send_base[dst] + index;
        const int pe = static_cast<int>(dst);
        uint8_t* row = sym.recv_x + slot * d.row_cap;
        int64_t* meta = sym.recv_meta + slot * meta_len;
        float* weights = sym.recv_weights + slot * K;
        // NVLink peers take plain stores through the mapped pointer; others go through
        // NVSHMEM's transports (bf16 only; fp8 needs mapped peers, checked on the host). Our own
        // row is self_rows_kernel's, but its metadata still goes to the slot: the copy-out
        // translates it for every slot, and the completion count covers it.
        auto* peer_row = static_cast<uint8_t*>(nvshmem_ptr(row, pe));
        if (dst != me && peer_row != nullptr) {
          mapped[num_mapped] = peer_row;
          mapped_scales[num_mapped++] = reinterpret_cast<float*>(peer_row + a.fp8_hidden);
        } else if (dst != me) {
          nvshmemx_putmem_nbi_warp(row, x_row, a.row_bytes, pe);
        }
        // A cached dispatch (rows_only) finds the plan dispatch's metadata and weights there.
        if (!a.rows_only && peer_row != nullptr) {
          auto* peer_meta = static_cast<int64_t*>(nvshmem_ptr(meta, pe));
          auto* peer_weights = static_cast<float*>(nvshmem_ptr(weights, pe));
          if (lane < meta_len) peer_meta[lane] = lane == 0 ? t : a.topk_idx[t * K + lane - 1];
          if (lane < K) peer_weights[lane] = a.topk_weights[t * K + lane];
        } else if (!a.rows_only) {
          if (lane < meta_len)
            nvshmem_int64_p(meta + lane, lane == 0 ? t : a.topk_idx[t * K + lane - 1], pe);
          if (lane < K) nvshmem_float_p(weights + lane, a.topk_weights[t * K + lane], pe);
        }
        if (lane == 0) atomicAdd(&sent[dst], 1ull);
      }
      if (num_mapped == 0) continue;
      if (a.fp8_hidden > 0) {
        warp_cast_fp8(mapped, mapped_scales, num_mapped,
                      reinterpret_cast<const __nv_bfloat16*>(x_row), a.fp8_hidden, lane);
      } else {
        warp_copy_multi(reinterpret_cast<void* const*>(mapped), num_mapped, x_row, a.row_bytes,
                        lane);
      }
    }
  }
  const auto owed = [&](int64_t s) { return a.plan.recv_offsets[s + 1] - a.plan.recv_offsets[s]; };
  signal_then_wait(sym.signals + kDispatchSignal * W, sent, sym.tally + kDispatchSignal, W, me,
                   owed, deadline, a.err, WaitOp::kDispatch);
}

// Our own rows, a warp per token: straight into the caller's output (the copy-out then skips
// them; at EP2 they are half the rows), or into our receive slots when the rows stay there. It
// reads only x and the send slots, so it runs beside the transfer, on the SMs the communication
// budget leaves, instead of on the transfer's SMs.
constexpr int kSelfThreads = 512;
__global__ void __launch_bounds__(kSelfThreads)
    self_rows_kernel(SymmetricView sym, EpDims d, DispatchArgs a, DispatchOutputs out) {
  if (*a.round_ok == 0) return;
  const int64_t W = d.world_size, me = d.rank;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * kSelfThreads + threadIdx.x) / 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * (kSelfThreads / 32);
  const int64_t out_row_bytes = a.fp8_hidden > 0 ? a.fp8_hidden : a.row_bytes;
  const int64_t scale_blocks = a.fp8_hidden / kFp8Block;
  for (int64_t t = warp; t < a.tokens; t += num_warps) {
    const int64_t index = a.send_index[t * W + me];
    if (index < 0) continue;
    const int64_t slot = a.plan.send_base[me] + index;
    uint8_t* dst =
        out.recv_x != nullptr ? out.recv_x + slot * out_row_bytes : sym.recv_x + slot * d.row_cap;
    const uint8_t* x_row = a.x + t * a.row_bytes;
    if (a.fp8_hidden > 0) {
      float* scales = out.recv_x != nullptr ? out.recv_scales + slot * scale_blocks
                                            : reinterpret_cast<float*>(dst + a.fp8_hidden);
      warp_cast_fp8(&dst, &scales, 1, reinterpret_cast<const __nv_bfloat16*>(x_row), a.fp8_hidden,
                    lane);
    } else {
      warp_copy(dst, x_row, a.row_bytes, lane);
    }
  }
}

// After the transfer: the peers' rows and every slot's metadata copied out of the symmetric
// buffer by the whole GPU (the communication SM budget only bounds the transfer). Our own rows
// are self_rows_kernel's.
__global__ void copy_out_kernel(SymmetricView sym, EpDims d, DispatchArgs a, DispatchOutputs out) {
  if (*a.round_ok == 0) return;
  const int64_t K = d.top_k, meta_len = 1 + K, first = d.rank * d.experts_per_rank;
  const int64_t N = a.plan.recv_offsets[d.world_size];
  const int64_t self_begin = a.plan.recv_offsets[d.rank];
  const int64_t self_slots = a.plan.recv_offsets[d.rank + 1] - self_begin;
  const int64_t x_bytes = a.fp8_hidden > 0 ? a.fp8_hidden : a.row_bytes;
  const int64_t vecs = out.recv_x != nullptr ? x_bytes / 16 : 0;
  const int64_t scales =
      a.fp8_hidden > 0 && out.recv_scales != nullptr ? a.fp8_hidden / kFp8Block : 0;
  const int64_t per_row = vecs + scales;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = begin; i < (N - self_slots) * per_row; i += stride) {
    int64_t slot = i / per_row;
    const int64_t j = i % per_row;
    if (slot >= self_begin) slot += self_slots;
    if (j < vecs) {
      reinterpret_cast<int4*>(out.recv_x + slot * x_bytes)[j] =
          load_streaming(reinterpret_cast<const int4*>(sym.recv_x + slot * d.row_cap) + j);
    } else {
      out.recv_scales[slot * scales + (j - vecs)] =
          reinterpret_cast<const float*>(sym.recv_x + slot * d.row_cap + a.fp8_hidden)[j - vecs];
    }
  }
  if (a.rows_only) return;
  for (int64_t i = begin; i < N * meta_len; i += stride) {
    const int64_t slot = i / meta_len, j = i % meta_len;
    if (j < K) {
      const int64_t g = sym.recv_meta[slot * meta_len + 1 + j];
      const bool local = g >= first && g < first + d.experts_per_rank;
      out.recv_topk_idx[slot * K + j] = local ? g - first : -1;
      out.recv_topk_weights[slot * K + j] = sym.recv_weights[slot * K + j];
    } else {
      out.recv_src[slot] = sym.recv_meta[slot * meta_len];
    }
  }
}

}  // namespace

void launch_transfer(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a, int blocks,
                     cudaStream_t stream) {
  transfer_kernel<<<blocks, kThreads, 0, stream>>>(sym, d, a);
}

void launch_self_rows(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a,
                      const DispatchOutputs& out, int blocks, cudaStream_t stream) {
  if (a.tokens == 0) return;
  self_rows_kernel<<<blocks, kSelfThreads, 0, stream>>>(sym, d, a, out);
}

void launch_copy_out(const SymmetricView& sym, const EpDims& d, const DispatchArgs& a,
                     const DispatchOutputs& out, int blocks, cudaStream_t stream) {
  copy_out_kernel<<<blocks, 512, 0, stream>>>(sym, d, a, out);
}

}  // namespace uniep::cuda
