// combine_rows_bf16 (include/uniep/cuda/send_rows.hpp): the MegaKernel's reduce of a rank's own
// tokens over the expert rows its dispatch planned, with the combines' arithmetic
// (cuda/common/combine_reduce.cuh), so its bits are those of every other combine.
#include <cuda_runtime.h>

#include "cuda/common/combine_reduce.cuh"
#include "cuda/common/dependent_launch.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/send_rows.cuh"
#include "uniep/cuda/send_rows.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 256;

// Each (t, k) reads row gemm_row[t, k] of y; a row past y is skipped and reported once (unless
// `error` is null).
__global__ void __launch_bounds__(kThreads)
    combine_rows_kernel(const uint8_t* __restrict__ y, int64_t y_rows,
                        const int64_t* __restrict__ gemm_row, const float* __restrict__ weights,
                        int64_t tokens, int64_t top_k, int64_t hidden, uint8_t* __restrict__ out,
                        unsigned long long* error) {
  // Launched while the kernel ahead (GEMM 2) may still run: y is read after this.
  wait_for_prior_grid();
  allow_next_grid();
  const int64_t row_bytes = hidden * 2;
  auto row_of = [&](int64_t t, int64_t k, int64_t v) -> const uint8_t* {
    const int64_t r = gemm_row[t * top_k + k];
    if (r < 0) return nullptr;
    if (r >= y_rows) {
      if (v == 0 && error != nullptr)
        megakernel::send_error(error, kSendRowOutOfRange, t * top_k + k);
      return nullptr;
    }
    return y + r * row_bytes;
  };
  weighted_rows_sum_bf16(row_of, weights, tokens, top_k, hidden, out);
}

}  // namespace

Status combine_rows_bf16(const void* y, int64_t y_rows, const int64_t* gemm_row,
                         const float* topk_weights, int64_t tokens, int64_t top_k, int64_t hidden,
                         void* out, unsigned long long* error, int blocks, cudaStream_t stream) {
  if (tokens < 0 || top_k < 1 || top_k > 32)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("combine_rows_bf16: tokens must be >= 0 and top_k in [1, 32], got ",
                            tokens, " and ", top_k)};
  if (hidden <= 0 || hidden % 8 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("hidden must be a positive multiple of 8 (16-byte bf16 vectors), got ",
                            hidden)};
  if (y_rows < 0 || blocks < 1)
    return {StatusCode::kInvalidArgument, "y_rows must be >= 0 and blocks >= 1"};
  if (tokens == 0) return Status::Ok();
  if (gemm_row == nullptr || topk_weights == nullptr || out == nullptr ||
      (y_rows > 0 && y == nullptr))
    return {StatusCode::kInvalidArgument,
            "combine_rows_bf16: y, gemm_row, topk_weights and out must be device pointers"};
  if (reinterpret_cast<uintptr_t>(y) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0)
    return {StatusCode::kInvalidArgument, "combine_rows_bf16: y and out must be 16-byte aligned"};
  // A failed launch leaves its error for launch_status.
  (void)launch_after_prior(combine_rows_kernel, dim3(blocks), dim3(kThreads), 0, stream,
                           static_cast<const uint8_t*>(y), y_rows, gemm_row, topk_weights, tokens,
                           top_k, hidden, static_cast<uint8_t*>(out), error);
  return launch_status("combine_rows_bf16");
}

}  // namespace uniep::cuda
