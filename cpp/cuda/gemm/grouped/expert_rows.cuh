// The walk over offs that the grouped problem kernels make (grouped_problems.cuh, the MegaKernel's
// forward and backward problem kernels) and gate_tile_base: each expert's row range from the
// cumulative row ends. The fp8 problem kernel (sm90_grouped_fp8.cu) gives each expert's block
// the same ranges by a max over the earlier ends.
#pragma once

#include <cstdint>

namespace uniep::cuda::grouped {

// One step of a warp's walk over offs in chunks of 32 experts (every lane calls it: it
// shuffles): lane's expert e = base + lane gets its row range [begin, end). Each end is clamped
// to [0, rows] and raised to the largest earlier end (a max-scan); `carry` (0 before the first
// chunk) is the end of the previous chunk's last expert and is advanced here. The ranges are then
// disjoint, ascending and inside [0, rows] whatever offs holds, so a malformed offs can give
// wrong rows but never an access out of bounds or two experts writing one row. For a valid offs
// the clamp changes nothing.
struct ExpertRows {
  int begin, end;
};

__device__ __forceinline__ ExpertRows expert_rows_step(const int32_t* __restrict__ offs, int e,
                                                       int num_experts, int rows, int lane,
                                                       int& carry) {
  int end = e < num_experts ? min(max(offs[e], 0), rows) : 0;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int v = __shfl_up_sync(0xffffffffu, end, d);
    if (lane >= d) end = max(end, v);
  }
  end = max(end, carry);
  int begin = __shfl_up_sync(0xffffffffu, end, 1);
  if (lane == 0) begin = carry;
  carry = __shfl_sync(0xffffffffu, end, 31);
  return {begin, end};
}

// The whole walk, by one warp (every lane calls it): fn(e, rows of e) for every expert e <
// num_experts, on lane e % 32.
template <class Fn>
__device__ __forceinline__ void for_each_expert_rows(const int32_t* __restrict__ offs,
                                                     int num_experts, int rows, int lane, Fn&& fn) {
  int carry = 0;  // end of the last expert of the previous chunk
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    const ExpertRows r = expert_rows_step(offs, e, num_experts, rows, lane, carry);
    if (e < num_experts) fn(e, r);
  }
}

}  // namespace uniep::cuda::grouped
