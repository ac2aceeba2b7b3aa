// The fp8 ping-pong 64 x 128 tile: each warpgroup has its own tile, so one's scale promotion and
// epilogue run while the other's WGMMAs do, and experts of few rows waste half as much of a tile.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_pingpong_64x128x128() {
  static const Entry e = make_entry<64, 1, 2, true>("fp8_pingpong_64x128x128");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
