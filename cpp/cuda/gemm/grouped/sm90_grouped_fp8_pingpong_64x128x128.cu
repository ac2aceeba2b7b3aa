// The fp8 ping-pong 64 x 128 tile: each warpgroup has its own tile, one's scale promotion and
// epilogue running while the other's WGMMAs do. The automatic choice for experts of a few rows
// (decode; uniep/tuning.hpp, grouped_gemm_fp8_auto_config); on one H100 it was slower than the
// cooperative tile on every prefill product measured.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_pingpong_64x128x128() {
  static const Entry e = make_entry<64, 1, 2, true>("fp8_pingpong_64x128x128");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
