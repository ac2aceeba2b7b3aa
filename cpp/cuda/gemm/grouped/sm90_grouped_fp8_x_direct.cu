// Experiment: the fp8 cooperative 128 x 128 tile with the plain product stored from the
// registers (StoreDirectEpilogue), picked only through UNIEP_X_FP8_DIRECT=1.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_x_coop_128x128x128_direct() {
  static const Entry e = make_x_direct_entry<128, 1, 2, false>("x_fp8_coop_128x128x128_direct");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
