// The argument checks of uniep::sender_rows and uniep::send_rows (the MegaKernel's dispatch on
// its own, include/uniep/cuda/send_rows.hpp), shared by the CPU and CUDA implementations so both
// refuse the same calls with the same messages.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace uniep::torch_glue {

// topk_idx [T, K] int64 (K in [1, 32]), expert_counts [W, E] int64 on the same device, E a
// multiple of W, rank in [0, W), tile_m in [1, 2^20].
void check_sender_rows_args(const at::Tensor& topk_idx, const at::Tensor& expert_counts,
                            int64_t rank, int64_t tile_m);

// topk_idx [T, K] int64 contiguous (K in [1, 32], T x K < 2^31), num_experts in [1, 2^30],
// tile_m in [1, 2^20]: uniep::expert_tiles.
void check_expert_tiles_args(const at::Tensor& topk_idx, int64_t num_experts, int64_t tile_m);

// The outputs expert_tiles and local_plan fill, on topk_idx's device: counts [E] int64, row ends
// [E] int32 and tile bases [E + 1] int32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_expert_tiles(const at::Tensor& topk_idx,
                                                                  int64_t num_experts);

// uniep::local_plan's outputs: counts, offs, tile_base, then dest_rank, gemm_row and counter
// [T, K] int64, and the error word [1] int64.
using LocalPlanTensors =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// x [T, H] contiguous (rows of H * element size bytes, a multiple of 16); dest_rank, gemm_row,
// counter [T, K] int64; rows [C, H'] of x's dtype, H' >= H, contiguous; counters [N] int32;
// all on x's device.
void check_send_rows_args(const at::Tensor& x, const at::Tensor& dest_rank,
                          const at::Tensor& gemm_row, const at::Tensor& counter,
                          const at::Tensor& rows, const at::Tensor& counters);

// y [R, H] bf16 contiguous, H a multiple of 8; gemm_row [T, K] int64 (K in [1, 32]);
// topk_weights [T, K] float32; all on y's device.
void check_combine_rows_args(const at::Tensor& y, const at::Tensor& gemm_row,
                             const at::Tensor& topk_weights);

// sticky and words of equal length; each pair contiguous, on one device, of one dtype (int32 or
// int64) and numel >= 1: uniep::keep_first_errors.
void check_keep_first_errors_args(const std::vector<at::Tensor>& sticky,
                                  const std::vector<at::Tensor>& words);

}  // namespace uniep::torch_glue
