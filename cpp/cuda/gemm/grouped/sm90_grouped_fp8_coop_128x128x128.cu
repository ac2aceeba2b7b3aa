// The fp8 cooperative 128 x 128 tile: two warpgroups share each tile; a 1 x 2 cluster shares
// each A tile between the two CTAs of a row. Also compiled with the SwiGLU epilogue (the first
// expert GEMM of moe_forward's fp8 experts), as every fp8 tile.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_coop_128x128x128() {
  static const Entry e = make_entry<128, 1, 2, false>("fp8_coop_128x128x128");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
