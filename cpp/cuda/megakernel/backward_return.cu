// moe_fused_backward_return_bf16 (include/uniep/cuda/fused_moe_backward.hpp): the fused
// backward's rows back to their source ranks, and each source's reduce over k.
//
// Two launches, so that no CTA of this rank waits while one of its own pushes is still queued
// behind it: the push (no waits), then the waits and the reduce. The peers' pushes run in their
// own launches, which never wait on this rank's reduce, so the waits always end (or time out).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/combine_reduce.cuh"
#include "cuda/common/warp_copy.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/send_rows.cuh"
#include "cuda/megakernel/tile_gate.cuh"
#include "uniep/cuda/fused_moe_backward.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 8;

__device__ __forceinline__ void store_release_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Warp w of `warps` takes rows w, w + warps, ... below rows_end: the row's gradient and dot to
// its source's slot, then the slot's flag.
__global__ void __launch_bounds__(kThreads) return_push_kernel(const FusedReturnArgs a) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t end = min(static_cast<int64_t>(max(*a.rows_end, 0)), a.capacity);
  const int64_t row_bytes = a.hidden * 2;
  const uint32_t epoch = static_cast<uint32_t>(*a.epoch_word);
  for (int64_t r = first; r < end; r += warps) {
    const int64_t src = a.row_src[r];
    const int64_t s = src / a.slots_per_rank, slot = src % a.slots_per_rank;
    if (src < 0 || s >= a.world_size) {
      if (lane == 0) megakernel::send_error(a.error, kSendRowOutOfRange, r);
      continue;
    }
    warp_copy<kUnroll>(static_cast<uint8_t*>(a.slots[s]) + slot * row_bytes,
                       static_cast<const uint8_t*>(a.grad_rows) + r * row_bytes, row_bytes,
                       lane);
    if (lane == 0) a.slot_dots[s][slot] = a.dots[r];
    // The source acquires the flag: every lane's stores before it at system scope.
    __threadfence_system();
    __syncwarp();
    if (lane == 0) store_release_u32(a.slot_flag[s] + slot, epoch);
  }
}

// Waits (every lane, so that each one's later loads are ordered after it) until `flag` holds
// this call's epoch. False if it timed out (recorded with flag 3).
__device__ __forceinline__ bool wait_slot(const FusedReturnArgs& a, const uint32_t* flag,
                                          uint32_t epoch, int64_t token, int k, int lane) {
  uint32_t have = megakernel::load_acquire_u32(flag);
  if (have == epoch) return true;
  const uint64_t deadline = a.timeout_ns ? global_timer_ns() + a.timeout_ns : ~0ull;
  while (have != epoch) {
    __nanosleep(128);
    if (global_timer_ns() > deadline) {
      if (lane == 0)
        megakernel::gate_report(a.timeout, 3u, static_cast<int>(token), k, have, epoch);
      return false;
    }
    if (megakernel::gate_failed(a.timeout)) return false;
    have = megakernel::load_acquire_u32(flag);
  }
  return true;
}

// Warp w of `warps` takes tokens w, w + warps, ...: waits for its used entries' slots, then
// grad_x[t] = sum over k ascending of slot (t, k), and grad_w[t, k] = the slot's dot.
__global__ void __launch_bounds__(kThreads) return_reduce_kernel(const FusedReturnArgs a) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kThreads / 32);
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int64_t K = a.top_k, vecs = a.hidden / 8, row_bytes = a.hidden * 2;
  const uint32_t epoch = static_cast<uint32_t>(*a.epoch_word);
  const auto* slots = static_cast<const uint8_t*>(a.slots[a.rank]);
  const uint32_t* flags = a.slot_flag[a.rank];
  for (int64_t t = first; t < a.tokens; t += warps) {
    bool used = false;  // lane k < K: entry (t, k)
    if (lane < K) used = a.gemm_row[t * K + lane] >= 0;
    for (int k = 0; k < K; ++k) {
      const bool uk = __shfl_sync(0xffffffffu, used, k);
      if (uk && !wait_slot(a, flags + t * K + k, epoch, t, k, lane))
        if (lane == k) used = false;  // its slot is garbage; leave it out
    }
    __syncwarp();
    if (lane < K) a.grad_w[t * K + lane] = used ? a.slot_dots[a.rank][t * K + lane] : 0.f;
    const uint32_t mask = __ballot_sync(0xffffffffu, used);
    for (int64_t v = lane; v < vecs; v += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int k = 0; k < K; ++k) {
        if (!(mask >> k & 1u)) continue;
        // Written by a peer during this call: a plain load after the acquire, not the
        // non-coherent path.
        const int4 raw = reinterpret_cast<const int4*>(slots + (t * K + k) * row_bytes)[v];
        accumulate_bf16x8(acc, raw, 1.0f);
      }
      reinterpret_cast<int4*>(static_cast<uint8_t*>(a.grad_x) + t * row_bytes)[v] =
          round_bf16x8(acc);
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

Status check_args(const FusedReturnArgs& a) {
  if (a.world_size < 1 || a.world_size > kMaxFusedPeers || a.rank < 0 ||
      a.rank >= a.world_size)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("world_size must be in [1, ", kMaxFusedPeers,
                            "] and rank in [0, world_size), got ", a.world_size, " and ", a.rank)};
  if (a.tokens < 0 || a.top_k < 1 || a.top_k > 32 || a.slots_per_rank < a.tokens * a.top_k)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("tokens must be >= 0, top_k in [1, 32] and slots_per_rank >= tokens "
                            "x top_k, got ",
                            a.tokens, ", ", a.top_k, " and ", a.slots_per_rank)};
  if (a.hidden <= 0 || a.hidden % 8 != 0 || a.capacity < 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("hidden must be a positive multiple of 8 and capacity >= 0, got ",
                            a.hidden, " and ", a.capacity)};
  const void* needed[] = {a.grad_rows, a.dots,  a.row_src,    a.rows_end, a.epoch_word,
                          a.error,     a.timeout};
  for (const void* p : needed)
    if (p == nullptr)
      return {StatusCode::kInvalidArgument,
              "moe_fused_backward_return_bf16: grad_rows, dots, row_src, rows_end, epoch_word, "
              "error and timeout must be device pointers"};
  if (a.tokens > 0 && (a.gemm_row == nullptr || a.grad_x == nullptr || a.grad_w == nullptr))
    return {StatusCode::kInvalidArgument,
            "moe_fused_backward_return_bf16: gemm_row, grad_x and grad_w must be device pointers"};
  for (int p = 0; p < a.world_size; ++p)
    if (a.slots[p] == nullptr || a.slot_dots[p] == nullptr || a.slot_flag[p] == nullptr ||
        !aligned16(a.slots[p]))
      return {StatusCode::kInvalidArgument,
              detail::str_cat("moe_fused_backward_return_bf16: rank ", p,
                              "'s slots, dots and flags must be device pointers (slots 16-byte "
                              "aligned)")};
  if (!aligned16(a.grad_rows) || !aligned16(a.grad_x))
    return {StatusCode::kInvalidArgument,
            "moe_fused_backward_return_bf16: grad_rows and grad_x must be 16-byte aligned"};
  return Status::Ok();
}

}  // namespace

Status moe_fused_backward_return_bf16(const FusedReturnArgs& a, int sm_count,
                                      cudaStream_t stream) {
  if (Status s = check_args(a); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  // A few blocks per SM: the push is bound by the links and the reduce by memory latency.
  const unsigned blocks = static_cast<unsigned>(std::max(1, 4 * sm_count));
  return_push_kernel<<<blocks, kThreads, 0, stream>>>(a);
  if (Status s = launch_status("the fused backward's return push"); !s.ok()) return s;
  if (a.tokens == 0) return Status::Ok();
  return_reduce_kernel<<<blocks, kThreads, 0, stream>>>(a);
  return launch_status("the fused backward's return reduce");
}

}  // namespace uniep::cuda
