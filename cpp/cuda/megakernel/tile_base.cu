// gate_tile_base (include/uniep/cuda/tile_gate.hpp): where each expert's tile counters start.
#include <cuda_runtime.h>

#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::cuda {
namespace {

// One warp walks the experts 32 at a time with the grouped GEMM's own clamp of offs, so the
// tiles counted here are the tiles its scheduler will hand out.
__global__ void __launch_bounds__(32)
    tile_base_kernel(const int32_t* __restrict__ offs, int num_experts, int rows, int tile_m,
                     int32_t* __restrict__ tile_base) {
  const int lane = static_cast<int>(threadIdx.x);
  int carry = 0, tiles_before = 0;
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    const grouped::ExpertRows r =
        grouped::expert_rows_step(offs, e, num_experts, rows, lane, carry);
    int tiles = e < num_experts ? (r.end - r.begin + tile_m - 1) / tile_m : 0;
    int incl = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (e < num_experts) tile_base[e] = tiles_before + incl - tiles;
    tiles_before += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) tile_base[num_experts] = tiles_before;
}

}  // namespace

Status gate_tile_base(const int32_t* offs, int64_t num_experts, int64_t rows, int tile_m,
                      int32_t* tile_base, cudaStream_t stream) {
  if (num_experts < 1 || num_experts > (1 << 30))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("num_experts must be in [1, 2^30], got ", num_experts)};
  if (rows < 0 || rows > (1ll << 31) - 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("rows must be in [0, 2^31), got ", rows)};
  if (tile_m < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("tile_m must be >= 1, got ", tile_m)};
  if (offs == nullptr || tile_base == nullptr)
    return {StatusCode::kInvalidArgument, "offs and tile_base must be device pointers"};
  tile_base_kernel<<<1, 32, 0, stream>>>(offs, static_cast<int>(num_experts),
                                         static_cast<int>(rows), tile_m, tile_base);
  return launch_status("gate_tile_base");
}

}  // namespace uniep::cuda
