// Experiment: the fp8 cooperative 128 x 128 tile's SwiGLU kernel with its rows staged in shared
// memory and stored by bulk copies, picked only through UNIEP_X_FP8_STAGED=1.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_x_coop_128x128x128_staged() {
  static const Entry e = make_x_staged_entry<128, 1, 2, false>("x_fp8_coop_128x128x128_staged");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
