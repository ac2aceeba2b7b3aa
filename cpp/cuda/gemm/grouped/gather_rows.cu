// gather_rows_bf16 and expert_offsets (include/uniep/cuda/grouped_gemm.hpp): the expert GEMM's
// input rows from the dispatch's receive slots, and its offs, each one launch. They replace
// index_select on a strided view and clone + cumsum + cast of the per-expert counts: on the
// H100 those aten calls cost 100-150 us of host time each while the GPU, drained by the
// dispatch's count sync, had nothing queued (traces of 2026-11-25, commit 228cd96).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

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

// Lists each slot's rows: inv[s * per_slot + j] for j < min(count[s], per_slot), in no fixed
// order (which warp lane stores a row does not change what lands there). A row past per_slot
// is copied here by its own thread.
__global__ void list_slot_rows_kernel(const int64_t* __restrict__ row_slot, int64_t rows,
                                      int64_t slots, int per_slot, int32_t* __restrict__ count,
                                      int32_t* __restrict__ inv, const uint8_t* __restrict__ src,
                                      int64_t src_stride, int64_t row_bytes,
                                      uint8_t* __restrict__ dst) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = row_slot[r];
    if (s < 0 || s >= slots) continue;
    const int j = atomicAdd(count + s, 1);
    if (j < per_slot) {
      inv[s * per_slot + j] = static_cast<int32_t>(r);
      continue;
    }
    const int4* from = reinterpret_cast<const int4*>(src + s * src_stride);
    int4* to = reinterpret_cast<int4*>(dst + r * row_bytes);
    for (int64_t i = 0; i < row_bytes / 16; ++i) to[i] = from[i];
  }
}

// One warp per slot: each 16-byte piece of the slot's row is loaded once and stored to every
// row listed for the slot.
__global__ void copy_slot_rows_kernel(const uint8_t* __restrict__ src, int64_t src_stride,
                                      int64_t slots, int per_slot,
                                      const int32_t* __restrict__ count,
                                      const int32_t* __restrict__ inv, int64_t row_bytes,
                                      uint8_t* __restrict__ dst) {
  constexpr int kUnroll = 4;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t n = row_bytes / 16;
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; s < slots;
       s += warps) {
    const int listed = min(count[s], per_slot);
    if (listed == 0) continue;
    const int mine = lane < listed ? inv[s * per_slot + lane] : -1;
    const int4* from = reinterpret_cast<const int4*>(src + s * src_stride);
    // The whole warp takes every step (the shuffles below need all lanes).
    for (int64_t base = 0; base < n; base += 32 * kUnroll) {
      const int64_t i = base + lane;
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + 32 * u < n) v[u] = load_streaming(from + i + 32 * u);
      for (int j = 0; j < listed; ++j) {
        const int64_t r = __shfl_sync(0xffffffffu, mine, j);
        int4* to = reinterpret_cast<int4*>(dst + r * row_bytes);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (i + 32 * u < n) to[i + 32 * u] = v[u];
      }
    }
  }
}

// offs[e] = counts[0] + ... + counts[e] as int32, one warp: 32 experts a step, a shuffle scan
// and a running carry (integer sums, so the order does not matter). One thread walking 128
// experts took 10 us a call on an H100 (2026-11-28, commit c7c5471).
__global__ void expert_offsets_kernel(const int64_t* __restrict__ counts, int64_t experts,
                                      int32_t* __restrict__ offs) {
  const int lane = threadIdx.x;
  int64_t carry = 0;
  for (int64_t base = 0; base < experts; base += 32) {
    const int64_t e = base + lane;
    int64_t sum = e < experts ? counts[e] : 0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t below = __shfl_up_sync(0xffffffffu, sum, d);
      if (lane >= d) sum += below;
    }
    if (e < experts) offs[e] = static_cast<int32_t>(carry + sum);
    carry += __shfl_sync(0xffffffffu, sum, 31);
  }
}

// Both gathers' argument checks; the pointers are checked only where there are rows to move.
Status check_gather_args(const void* src, int64_t src_stride_bytes, int64_t slots,
                         const int64_t* row_slot, int64_t rows, int64_t cols, const void* dst) {
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
  return Status::Ok();
}

}  // namespace

Status gather_rows_bf16(const void* src, int64_t src_stride_bytes, int64_t slots,
                        const int64_t* row_slot, int64_t rows, int64_t cols, void* dst,
                        cudaStream_t stream) {
  if (Status s = check_gather_args(src, src_stride_bytes, slots, row_slot, rows, cols, dst);
      !s.ok() || rows == 0)
    return s;
  const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, 132 * 8);
  gather_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(src), src_stride_bytes, slots, row_slot, rows, cols * 2,
      static_cast<uint8_t*>(dst));
  return launch_status("gather_rows_bf16");
}

size_t gather_rows_workspace_bytes(int64_t slots, int per_slot) {
  if (slots < 1 || per_slot < 1) return 0;
  // count [slots] then inv [slots * per_slot], int32; inv 16-byte aligned.
  const size_t count = (static_cast<size_t>(slots) * 4 + 15) / 16 * 16;
  return count + static_cast<size_t>(slots) * static_cast<size_t>(per_slot) * 4;
}

Status gather_rows_bf16(const void* src, int64_t src_stride_bytes, int64_t slots,
                        const int64_t* row_slot, int64_t rows, int64_t cols, int per_slot,
                        void* workspace, size_t workspace_bytes, void* dst, cudaStream_t stream) {
  if (per_slot < 1 || per_slot > 32)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("gather_rows_bf16: per_slot must be in [1, 32], got ", per_slot)};
  if (rows > std::numeric_limits<int32_t>::max())
    return {StatusCode::kInvalidArgument,
            detail::str_cat("gather_rows_bf16: rows must be below 2^31, got ", rows)};
  if (Status s = check_gather_args(src, src_stride_bytes, slots, row_slot, rows, cols, dst);
      !s.ok() || rows == 0)
    return s;
  // Rows but no slots: every row_slot entry is out of range, and nothing is copied.
  if (slots == 0) return Status::Ok();
  const size_t need = gather_rows_workspace_bytes(slots, per_slot);
  if (workspace == nullptr || workspace_bytes < need ||
      reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("gather_rows_bf16: needs ", need,
                            " bytes of 16-byte aligned workspace, got ", workspace_bytes)};
  auto* count = static_cast<int32_t*>(workspace);
  auto* inv = reinterpret_cast<int32_t*>(static_cast<char*>(workspace) +
                                         (static_cast<size_t>(slots) * 4 + 15) / 16 * 16);
  if (cudaError_t e = cudaMemsetAsync(count, 0, static_cast<size_t>(slots) * 4, stream);
      e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("gather_rows_bf16: clearing the slot counts failed: ",
                            cudaGetErrorString(e))};
  const int64_t list_blocks = std::min<int64_t>((rows + kThreads - 1) / kThreads, 132 * 8);
  list_slot_rows_kernel<<<static_cast<unsigned>(list_blocks), kThreads, 0, stream>>>(
      row_slot, rows, slots, per_slot, count, inv, static_cast<const uint8_t*>(src),
      src_stride_bytes, cols * 2, static_cast<uint8_t*>(dst));
  if (Status s = launch_status("gather_rows_bf16 (listing)"); !s.ok()) return s;
  const int64_t blocks = std::min<int64_t>((slots + kWarps - 1) / kWarps, 132 * 8);
  copy_slot_rows_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(src), src_stride_bytes, slots, per_slot, count, inv, cols * 2,
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
  expert_offsets_kernel<<<1, 32, 0, stream>>>(counts, experts, offs);
  return launch_status("expert_offsets");
}

}  // namespace uniep::cuda
