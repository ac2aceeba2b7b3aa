// fused_exchange_counts (exchange.hpp).
#include <cuda_runtime.h>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/exchange.hpp"
#include "cuda/megakernel/tile_gate.cuh"
#include "uniep/cuda/fused_ep.hpp"

namespace uniep::cuda {
namespace megakernel {
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxExperts = static_cast<int>(fused::kMaxExperts);

__device__ __forceinline__ void store_release_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__global__ void __launch_bounds__(kThreads) fused_exchange_kernel(const FusedExchangeArgs a) {
  __shared__ unsigned int counts[kMaxExperts];
  __shared__ uint64_t call_epoch;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t E = a.num_experts, W = a.world_size, El = E / W, n = a.tokens * a.top_k;
  if (tid == 0) call_epoch = a.epoch_word != nullptr ? *a.epoch_word + 1 : a.epoch;
  for (int64_t g = tid; g < E; g += kThreads) counts[g] = 0;
  __syncthreads();
  const uint64_t epoch = call_epoch;
  const int64_t shift =
      a.epoch_word != nullptr ? static_cast<int64_t>(epoch & 1) * a.counts_parity_stride : 0;
  if (a.epoch_word != nullptr) {
    // Peers touch these only after this rank's announcement below, which the fence orders after.
    uint32_t* by_parity = a.zero_by_parity + static_cast<int64_t>(epoch & 1) * a.zero_count;
    for (int64_t i = tid; i < a.zero_count; i += kThreads) {
      a.zero_always[0][i] = 0u;
      a.zero_always[1][i] = 0u;
      by_parity[i] = 0u;
    }
  }
  for (int64_t i = tid; i < n; i += kThreads) {
    const int64_t id = a.topk_idx[i];
    if (id >= 0 && id < E) atomicAdd(&counts[id], 1u);
  }
  __syncthreads();
  for (int64_t j = tid; j < W * E; j += kThreads) {
    const int64_t p = j / E, g = j % E;
    a.peer_counts[p][shift + a.rank * E + g] = counts[g];
  }
  // Every thread's stores reach the peers before any of them sees this rank's epoch.
  __threadfence_system();
  __syncthreads();
  if (tid < W) store_release_u64(a.peer_arrived[tid] + a.rank, epoch);
  if (tid < W) {
    // Peer tid's words arrive in this rank's own arrival array.
    const uint64_t* word = a.peer_arrived[a.rank] + tid;
    uint64_t have = load_acquire_sys(word);
    const uint64_t deadline = a.timeout_ns ? global_timer_ns() + a.timeout_ns : ~0ull;
    while (have < epoch) {
      __nanosleep(256);
      if (global_timer_ns() > deadline) {
        gate_report(a.timeout, 4u, tid, 0, static_cast<uint32_t>(have),
                    static_cast<uint32_t>(epoch));
        break;
      }
      have = load_acquire_sys(word);
    }
  }
  __syncthreads();
  __threadfence();
  const int64_t* m = a.peer_counts[a.rank] + shift;
  if (a.counts_out != nullptr)
    for (int64_t j = tid; j < W * E; j += kThreads) a.counts_out[j] = m[j];
  if (tid == 0) {
    int64_t end = 0;
    for (int64_t e = 0; e < El; ++e) {
      for (int64_t s = 0; s < W; ++s) end += m[s * E + a.rank * El + e];
      a.offs[e] = static_cast<int32_t>(end);
    }
    if (a.epoch_word != nullptr) *a.epoch_word = epoch;
  }
}

}  // namespace
}  // namespace megakernel

Status fused_exchange_counts(const FusedExchangeArgs& a, cudaStream_t stream) {
  if (a.num_experts < 1 || a.num_experts > megakernel::kMaxExperts || a.world_size < 1 ||
      a.world_size > kMaxFusedPeers || a.num_experts % a.world_size != 0 || a.rank < 0 ||
      a.rank >= a.world_size)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("fused_exchange_counts: num_experts must be a multiple of the world "
                            "size in [1, ",
                            megakernel::kMaxExperts, "], world_size in [1, ", kMaxFusedPeers,
                            "] and rank below it, got ", a.num_experts, ", ", a.world_size,
                            " and ", a.rank)};
  if (a.tokens < 0 || a.top_k < 1 || (a.tokens > 0 && a.topk_idx == nullptr) ||
      a.offs == nullptr || a.timeout == nullptr || (a.epoch == 0 && a.epoch_word == nullptr))
    return {StatusCode::kInvalidArgument,
            "fused_exchange_counts: tokens >= 0, top_k >= 1, epoch >= 1 (or epoch_word) and the "
            "topk_idx, offs and timeout pointers are required"};
  if (a.epoch_word != nullptr &&
      (a.counts_parity_stride < a.world_size * a.num_experts || a.zero_count < 0 ||
       (a.zero_count > 0 && (a.zero_always[0] == nullptr || a.zero_always[1] == nullptr ||
                             a.zero_by_parity == nullptr))))
    return {StatusCode::kInvalidArgument,
            "fused_exchange_counts: with epoch_word, counts_parity_stride must be >= W x E and "
            "the zeroed words' pointers set"};
  for (int p = 0; p < a.world_size; ++p)
    if (a.peer_counts[p] == nullptr || a.peer_arrived[p] == nullptr)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("fused_exchange_counts: rank ", p,
                              "'s counts and arrival words must be mapped")};
  megakernel::fused_exchange_kernel<<<1, megakernel::kThreads, 0, stream>>>(a);
  return launch_status("fused_exchange_counts");
}

}  // namespace uniep::cuda
