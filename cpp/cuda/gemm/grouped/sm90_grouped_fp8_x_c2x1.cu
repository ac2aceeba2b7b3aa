// Experiment: the fp8 cooperative 128 x 128 tile on 2 x 1 clusters (B, the weights, shared
// along M instead of A along N). Picked only through UNIEP_X_CLUSTER=2x1.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_x_coop_128x128x128_c2x1() {
  static const Entry e = make_entry<128, 2, 1, false>("x_fp8_coop_128x128x128_c2x1");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
