// plan_sender_rows_async, send_rows_async and store_token_rows_async
// (include/uniep/cuda/send_rows.hpp) as kernels of their own; the persistent kernel runs the same
// device functions (send_rows.cuh).
#include <cuda_runtime.h>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/send_rows.cuh"

namespace uniep::cuda {
namespace {

// One block per global expert walks all of the rank's entries, one chunk of kPlanThreads per
// block scan: at 256 threads DeepSeek-V3's rank (32,768 entries) took 128 scans and 77 us on an
// H100, on the critical path of every layer.
constexpr int kPlanThreads = 1024;
constexpr int kSendThreads = 256;

__global__ void __launch_bounds__(kPlanThreads) sender_rows_plan_kernel(SenderRowsPlanArgs a) {
  megakernel::plan_expert_rows<kPlanThreads>(a, blockIdx.x);
}

__global__ void __launch_bounds__(kSendThreads) send_rows_kernel(SendRowsArgs a, RowPeers p) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kSendThreads / 32);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (kSendThreads / 32) + threadIdx.x / 32;
       t < a.tokens; t += warps)
    megakernel::send_token_row(a, p, t, lane);
}

__global__ void __launch_bounds__(kSendThreads) store_token_rows_kernel(StoreRowsArgs a) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kSendThreads / 32);
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * (kSendThreads / 32) + threadIdx.x / 32;
       t < a.tokens; t += warps)
    megakernel::store_token_row(a, t, lane);
}

Status check_routing_shape(int64_t tokens, int64_t top_k) {
  if (tokens < 0 || tokens > (int64_t{1} << 40))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("tokens must be in [0, 2^40], got ", tokens)};
  if (top_k < 1 || top_k > 32)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("top_k must be in [1, 32] (a lane per entry of a token), got ",
                            top_k)};
  return Status::Ok();
}

}  // namespace

Status plan_sender_rows_async(const SenderRowsPlanArgs& a, cudaStream_t stream) {
  if (Status s = check_routing_shape(a.tokens, a.top_k); !s.ok()) return s;
  if (a.world_size < 1 || a.rank < 0 || a.rank >= a.world_size)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("rank must be in [0, world_size = ", a.world_size, "), got ", a.rank)};
  if (a.num_experts < 1 || a.num_experts % a.world_size != 0 || a.num_experts > (1 << 20))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("num_experts must be a positive multiple of world_size = ",
                            a.world_size, " (at most 2^20), got ", a.num_experts)};
  if (a.counts_ld < a.num_experts)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("counts_ld must be >= num_experts = ", a.num_experts, ", got ",
                            a.counts_ld)};
  if (a.tile_m < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("tile_m must be >= 1, got ", a.tile_m)};
  // Without tokens the outputs are empty (torch gives them no storage) and nothing is read.
  if (a.error == nullptr ||
      (a.tokens > 0 && (a.counts == nullptr || a.dest_rank == nullptr || a.gemm_row == nullptr ||
                        a.counter == nullptr || a.topk_idx == nullptr)))
    return {StatusCode::kInvalidArgument,
            "plan_sender_rows_async: error, and with tokens topk_idx, counts and the three outputs, "
            "must be device pointers"};
  if (a.tokens == 0) return Status::Ok();
  sender_rows_plan_kernel<<<static_cast<unsigned>(a.num_experts), kPlanThreads, 0, stream>>>(a);
  return launch_status("plan_sender_rows_async");
}

Status preload_send_rows_kernels() {
  cudaFuncAttributes attr;
  cudaError_t e = cudaFuncGetAttributes(&attr, sender_rows_plan_kernel);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, send_rows_kernel);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it for the caller's next launch check
    return {StatusCode::kInternal, detail::str_cat("preload_send_rows_kernels: could not load "
                                                   "the send kernels: ",
                                                   cudaGetErrorString(e))};
  }
  return Status::Ok();
}

Status send_rows_async(const SendRowsArgs& a, const RowPeers& peers, int blocks,
                       cudaStream_t stream) {
  if (Status s = check_routing_shape(a.tokens, a.top_k); !s.ok()) return s;
  if (peers.num_peers < 1 || peers.num_peers > kMaxRowPeers)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("the peer table must hold 1 to ", kMaxRowPeers, " ranks, got ",
                            peers.num_peers)};
  for (int d = 0; d < peers.num_peers && a.tokens > 0; ++d)  // without tokens none is written
    if (peers.rows[d] == nullptr || peers.counters[d] == nullptr)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("rank ", d, " of the peer table has no rows or counters pointer")};
  if (a.row_bytes <= 0 || a.row_bytes % 16 != 0 || a.row_bytes > peers.row_stride ||
      peers.row_stride % 16 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("row_bytes must be a positive multiple of 16 of at most the "
                            "destination's row stride (a multiple of 16, ",
                            peers.row_stride, " bytes), got ", a.row_bytes)};
  if (a.x_stride < a.row_bytes || a.x_stride % 16 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("x_stride must be a multiple of 16 of at least row_bytes = ",
                            a.row_bytes, ", got ", a.x_stride)};
  if (reinterpret_cast<uintptr_t>(a.x) % 16 != 0)
    return {StatusCode::kInvalidArgument, "x must be 16-byte aligned"};
  if (peers.rows_capacity < 0 || peers.num_counters < 0)
    return {StatusCode::kInvalidArgument, "rows_capacity and num_counters must be >= 0"};
  if (blocks < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("blocks must be >= 1, got ", blocks)};
  if (a.error == nullptr || (a.tokens > 0 && (a.x == nullptr || a.dest_rank == nullptr ||
                                              a.gemm_row == nullptr || a.counter == nullptr)))
    return {StatusCode::kInvalidArgument,
            "send_rows_async: x, dest_rank, gemm_row, counter and error must be device pointers"};
  if (a.tokens == 0) return Status::Ok();
  send_rows_kernel<<<blocks, kSendThreads, 0, stream>>>(a, peers);
  return launch_status("send_rows_async");
}

Status store_token_rows_async(const StoreRowsArgs& a, int blocks, cudaStream_t stream) {
  if (Status s = check_routing_shape(a.tokens, a.top_k); !s.ok()) return s;
  if (a.row_bytes <= 0 || a.row_bytes % 16 != 0 || a.row_bytes > a.row_stride ||
      a.row_stride % 16 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("store_token_rows_async: row_bytes must be a positive multiple of 16 "
                            "of at most row_stride (a multiple of 16, ",
                            a.row_stride, " bytes), got ", a.row_bytes)};
  if (a.x_stride < a.row_bytes || a.x_stride % 16 != 0 ||
      reinterpret_cast<uintptr_t>(a.x) % 16 != 0 || reinterpret_cast<uintptr_t>(a.rows) % 16 != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("store_token_rows_async: x and rows must be 16-byte aligned and "
                            "x_stride a multiple of 16 of at least row_bytes = ",
                            a.row_bytes, ", got ", a.x_stride)};
  if (a.rows_capacity < 0 || blocks < 1)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("store_token_rows_async: rows_capacity must be >= 0 and blocks >= 1, "
                            "got ",
                            a.rows_capacity, " and ", blocks)};
  if (a.tokens > 0 &&
      (a.x == nullptr || a.gemm_row == nullptr || (a.rows_capacity > 0 && a.rows == nullptr)))
    return {StatusCode::kInvalidArgument,
            "store_token_rows_async: x, gemm_row and rows must be device pointers"};
  if (a.tokens == 0) return Status::Ok();
  store_token_rows_kernel<<<blocks, kSendThreads, 0, stream>>>(a);
  return launch_status("store_token_rows_async");
}

}  // namespace uniep::cuda
