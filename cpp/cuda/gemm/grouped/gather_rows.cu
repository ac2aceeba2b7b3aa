// gather_rows_bf16 and expert_offsets (include/uniep/cuda/grouped_gemm.hpp): the expert GEMM's
// input rows from the dispatch's receive slots, and its offs, each one launch. They replace
// index_select on a strided view and clone + cumsum + cast of the per-expert counts: on the
// H100 those aten calls cost 100-150 us of host time each while the GPU, drained by the
// dispatch's count sync, had nothing queued (bench/results/2026-11-25-h100-session14).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/warp_copy.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// One warp per row; a slot outside [0, slots) is an error the launcher's caller prevents (the
// plan made row_slot), so it is skipped rather than read out of bounds.
__global__ void gather_rows_kernel(const uint8_t* __restrict__ src, int64_t src_stride,
                                   int64_t slots, const int64_t* __restrict__ row_slot,
                                   int64_t rows, int64_t row_bytes, uint8_t* __restrict__ dst) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; r < rows;
       r += warps) {
    const int64_t s = row_slot[r];
    if (s < 0 || s >= slots) continue;
    warp_copy<4>(dst + r * row_bytes, src + s * src_stride, row_bytes, lane);
  }
}

// offs[e] = counts[0] + ... + counts[e] as int32, one thread (a few hundred experts at most).
__global__ void expert_offsets_kernel(const int64_t* __restrict__ counts, int64_t experts,
                                      int32_t* __restrict__ offs) {
  int64_t sum = 0;
  for (int64_t e = 0; e < experts; ++e) {
    sum += counts[e];
    offs[e] = static_cast<int32_t>(sum);
  }
}

}  // namespace

Status gather_rows_bf16(const void* src, int64_t src_stride_bytes, int64_t slots,
                        const int64_t* row_slot, int64_t rows, int64_t cols, void* dst,
                        cudaStream_t stream) {
  if (rows < 0 || slots < 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("gather_rows_bf16: rows and slots must be >= 0, got ", rows, " and ",
                            slots)};
  if (cols < 1 || cols % 8 != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat("gather_rows_bf16: cols must be a positive multiple of 8, got ", cols)};
  if (src_stride_bytes < cols * 2 || src_stride_bytes % 16 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("gather_rows_bf16: src_stride_bytes must be a multiple of 16 and at "
                            "least cols * 2 = ",
                            cols * 2, ", got ", src_stride_bytes)};
  if (rows == 0) return Status::Ok();
  if (src == nullptr || row_slot == nullptr || dst == nullptr ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0)
    return {StatusCode::kUnsupported,
            "gather_rows_bf16: src and dst must be 16-byte aligned (non-null)"};
  const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, 132 * 8);
  gather_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(src), src_stride_bytes, slots, row_slot, rows, cols * 2,
      static_cast<uint8_t*>(dst));
  return launch_status("gather_rows_bf16");
}

Status expert_offsets(const int64_t* counts, int64_t experts, int32_t* offs, cudaStream_t stream) {
  if (experts < 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("expert_offsets: experts must be >= 0, got ", experts)};
  if (experts == 0) return Status::Ok();
  if (counts == nullptr || offs == nullptr)
    return {StatusCode::kInvalidArgument, "expert_offsets: counts and offs must be non-null"};
  expert_offsets_kernel<<<1, 1, 0, stream>>>(counts, experts, offs);
  return launch_status("expert_offsets");
}

}  // namespace uniep::cuda
