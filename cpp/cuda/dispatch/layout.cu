// Routing layout kernel: per-expert and per-rank counts and the token -> rank map that the dispatch
// plan is built from (uniep/cuda/layout.hpp documents the contract).
//
// One thread per token, one block per kTokensPerBlock tokens. Counts go to a shared-memory
// histogram first and then to global memory with one atomic per non-empty bin and block: integer
// sums do not depend on the order the atomics land in, so the result is bit-identical run to run
// and to the CPU planner without a second pass.
#include <cuda_runtime.h>

// This file is the first of the dispatch kernels, which all link against NVSHMEM's device library
// (one-sided puts and signals); including the device API here makes a broken NVSHMEM include or
// device-link setup fail in CI, where no GPU exists, instead of in the first kernel that puts.
#include <nvshmem.h>

// CuTe tensors name the row-major [T, K] and [T, W] views instead of hand-written index maths;
// tensor.hpp only (no CUTLASS GEMM headers) keeps this file cheap to compile.
#include <cute/tensor.hpp>

#include <cstdint>
#include <cstdio>
#include <limits>

#include "uniep/cuda/layout.hpp"
#include "uniep/shape.hpp"

namespace uniep::cuda {
namespace {

constexpr int kTokensPerBlock = 128;
// Above this many bins the histogram no longer fits the default 48 KiB of shared memory per
// block; the kernel then adds straight into global memory (still exact, just more contention).
constexpr int64_t kMaxSharedBins = (48 * 1024) / sizeof(unsigned long long);

__device__ void report_bad_expert(unsigned long long* error_word, int64_t token, int64_t slot,
                                  int64_t top_k, int64_t expert, int64_t num_experts) {
  if (error_word != nullptr) {
    // The smallest index wins, so the host reports the same entry as a row-major CPU scan.
    atomicMin(error_word, static_cast<unsigned long long>(token * top_k + slot));
    return;
  }
  printf("uniep routing_layout: topk_idx[%lld, %lld] = %lld is outside [-1, %lld)\n",
         static_cast<long long>(token), static_cast<long long>(slot),
         static_cast<long long>(expert), static_cast<long long>(num_experts));
  __trap();
}

__global__ void __launch_bounds__(kTokensPerBlock)
    routing_layout_kernel(const int64_t* __restrict__ topk_idx, int64_t tokens, int64_t top_k,
                          int64_t num_experts, int64_t world_size, int64_t* tokens_per_rank,
                          int64_t* tokens_per_expert, bool* token_in_rank,
                          unsigned long long* error_word, bool shared_bins) {
  // [num_experts] expert bins, then [world_size] rank bins.
  extern __shared__ unsigned long long bins[];
  const int64_t num_bins = num_experts + world_size;
  // Counts are non-negative, so the int64 outputs can take unsigned 64-bit atomics.
  auto* global_experts = reinterpret_cast<unsigned long long*>(tokens_per_expert);
  auto* global_ranks = reinterpret_cast<unsigned long long*>(tokens_per_rank);
  unsigned long long* expert_bins = shared_bins ? bins : global_experts;
  unsigned long long* rank_bins = shared_bins ? bins + num_experts : global_ranks;
  if (shared_bins) {
    for (int64_t i = threadIdx.x; i < num_bins; i += blockDim.x) bins[i] = 0;
    __syncthreads();
  }

  const auto idx =
      cute::make_tensor(cute::make_gmem_ptr(topk_idx),
                        cute::make_layout(cute::make_shape(tokens, top_k), cute::LayoutRight{}));
  const auto in_rank = cute::make_tensor(
      cute::make_gmem_ptr(token_in_rank),
      cute::make_layout(cute::make_shape(tokens, world_size), cute::LayoutRight{}));
  const int64_t experts_per_rank = num_experts / world_size;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kTokensPerBlock + threadIdx.x;
  if (t < tokens) {
    for (int64_t r = 0; r < world_size; ++r) in_rank(t, r) = false;
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t e = idx(t, k);
      if (e == -1) continue;
      if (e < -1 || e >= num_experts) {
        report_bad_expert(error_word, t, k, top_k, e, num_experts);
        continue;
      }
      atomicAdd(&expert_bins[e], 1ull);
      // The row doubles as the "rank already counted" set: only this thread touches it, so it
      // reads its own earlier stores, and a token with several experts on one rank counts once.
      const int64_t r = e / experts_per_rank;
      if (!in_rank(t, r)) {
        in_rank(t, r) = true;
        atomicAdd(&rank_bins[r], 1ull);
      }
    }
  }

  if (shared_bins) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < num_bins; i += blockDim.x) {
      const unsigned long long count = bins[i];
      if (count == 0) continue;
      atomicAdd(i < num_experts ? &global_experts[i] : &global_ranks[i - num_experts], count);
    }
  }
}

// One launch instead of three memsets: on the dispatch's path each was a few microseconds of
// launch gap before the layout kernel.
__global__ void reset_layout_outputs(int64_t* tokens_per_rank, int64_t world_size,
                                     int64_t* tokens_per_expert, int64_t num_experts,
                                     unsigned long long* error_word) {
  for (int64_t i = threadIdx.x; i < world_size; i += blockDim.x) tokens_per_rank[i] = 0;
  for (int64_t i = threadIdx.x; i < num_experts; i += blockDim.x) tokens_per_expert[i] = 0;
  if (threadIdx.x == 0 && error_word != nullptr) *error_word = kNoLayoutError;
}

Status invalid(const std::string& message) {
  return {StatusCode::kInvalidArgument, message};
}

Status cuda_error(cudaError_t err, const char* what) {
  return {StatusCode::kInternal,
          detail::str_cat("routing_layout: ", what, " failed: ", cudaGetErrorString(err))};
}

#define UNIEP_RETURN_IF_CUDA_ERROR(expr, what)            \
  do {                                                    \
    const cudaError_t uniep_err_ = (expr);                \
    if (uniep_err_ != cudaSuccess) {                      \
      return ::uniep::cuda::cuda_error(uniep_err_, what); \
    }                                                     \
  } while (0)

}  // namespace

Status validate_routing_layout(int64_t tokens, int64_t top_k, int64_t num_experts,
                               int64_t world_size) {
  // Order and wording follow MoeShape::validate, so both devices reject a call the same way.
  if (tokens < 0) return invalid(detail::str_cat("tokens must be >= 0, got ", tokens));
  if (world_size < 1) return invalid(detail::str_cat("world_size must be > 0, got ", world_size));
  if (world_size > kMaxWorldSize) {
    return invalid(detail::str_cat("world_size must be <= ", kMaxWorldSize,
                                   " (2**16, uniep::kMaxWorldSize), got ", world_size));
  }
  if (num_experts < 1) {
    return invalid(detail::str_cat("num_experts must be > 0, got ", num_experts));
  }
  if (num_experts > kMaxExperts) {
    return invalid(detail::str_cat("num_experts must be <= ", kMaxExperts,
                                   " (2**20, uniep::kMaxExperts), got ", num_experts));
  }
  if (num_experts % world_size != 0) {
    return invalid(detail::str_cat("num_experts (", num_experts,
                                   ") must be divisible by the world size (", world_size, ")"));
  }
  if (top_k < 1) return invalid(detail::str_cat("top_k must be > 0, got ", top_k));
  return Status::Ok();
}

Status routing_layout_async(const int64_t* topk_idx, int64_t tokens, int64_t top_k,
                            int64_t num_experts, int64_t world_size, int64_t* tokens_per_rank,
                            int64_t* tokens_per_expert, bool* token_in_rank,
                            unsigned long long* error_word, cudaStream_t stream) {
  if (Status s = validate_routing_layout(tokens, top_k, num_experts, world_size); !s.ok()) return s;
  if (tokens_per_rank == nullptr) return invalid("tokens_per_rank must not be null");
  if (tokens_per_expert == nullptr) return invalid("tokens_per_expert must not be null");
  if (tokens > 0 && topk_idx == nullptr) return invalid("topk_idx must not be null");
  if (tokens > 0 && token_in_rank == nullptr) return invalid("token_in_rank must not be null");
  const int64_t blocks = cute::ceil_div(tokens, int64_t{kTokensPerBlock});
  if (blocks > std::numeric_limits<int>::max()) {
    return invalid(detail::str_cat("tokens (", tokens, ") exceeds the grid limit of ",
                                   int64_t{std::numeric_limits<int>::max()} * kTokensPerBlock));
  }

  // The kernel accumulates into the outputs, and a zero-token call must still return zeros.
  reset_layout_outputs<<<1, kTokensPerBlock, 0, stream>>>(
      tokens_per_rank, world_size, tokens_per_expert, num_experts, error_word);
  UNIEP_RETURN_IF_CUDA_ERROR(cudaGetLastError(), "reset_layout_outputs launch");
  if (tokens == 0) return Status::Ok();

  const int64_t num_bins = num_experts + world_size;
  const bool shared_bins = num_bins <= kMaxSharedBins;
  const size_t smem = shared_bins ? sizeof(unsigned long long) * num_bins : 0;
  routing_layout_kernel<<<static_cast<unsigned>(blocks), kTokensPerBlock, smem, stream>>>(
      topk_idx, tokens, top_k, num_experts, world_size, tokens_per_rank, tokens_per_expert,
      token_in_rank, error_word, shared_bins);
  UNIEP_RETURN_IF_CUDA_ERROR(cudaGetLastError(), "routing_layout_kernel launch");
  return Status::Ok();
}

Status check_routing_layout(const int64_t* topk_idx, int64_t top_k, int64_t num_experts,
                            const unsigned long long* error_word, cudaStream_t stream) {
  if (error_word == nullptr) return invalid("error_word must not be null");
  if (top_k < 1) return invalid(detail::str_cat("top_k must be > 0, got ", top_k));
  unsigned long long first_bad = kNoLayoutError;
  UNIEP_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(&first_bad, error_word, sizeof(first_bad), cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync");
  UNIEP_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (first_bad == kNoLayoutError) return Status::Ok();
  int64_t expert = 0;
  UNIEP_RETURN_IF_CUDA_ERROR(
      cudaMemcpy(&expert, topk_idx + first_bad, sizeof(expert), cudaMemcpyDeviceToHost),
      "cudaMemcpy");
  const auto index = static_cast<int64_t>(first_bad);
  return invalid(bad_expert_id_message(expert, index / top_k, index % top_k, num_experts));
}

Status routing_layout(const int64_t* topk_idx, int64_t tokens, int64_t top_k, int64_t num_experts,
                      int64_t world_size, int64_t* tokens_per_rank, int64_t* tokens_per_expert,
                      bool* token_in_rank, cudaStream_t stream) {
  unsigned long long* error_word = nullptr;
  UNIEP_RETURN_IF_CUDA_ERROR(cudaMallocAsync(&error_word, sizeof(*error_word), stream),
                             "cudaMallocAsync");
  Status status =
      routing_layout_async(topk_idx, tokens, top_k, num_experts, world_size, tokens_per_rank,
                           tokens_per_expert, token_in_rank, error_word, stream);
  if (status.ok()) status = check_routing_layout(topk_idx, top_k, num_experts, error_word, stream);
  const cudaError_t free_err = cudaFreeAsync(error_word, stream);
  if (status.ok() && free_err != cudaSuccess) return cuda_error(free_err, "cudaFreeAsync");
  return status;
}

}  // namespace uniep::cuda
