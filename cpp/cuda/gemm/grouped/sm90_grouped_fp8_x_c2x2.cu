// Experiment: the fp8 cooperative 128 x 128 tile on 2 x 2 clusters (A and B each shared by two
// CTAs: a third less L2 read per tile than 1 x 2). Picked only through UNIEP_X_CLUSTER=2x2.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_x_coop_128x128x128_c2x2() {
  static const Entry e = make_entry<128, 2, 2, false>("x_fp8_coop_128x128x128_c2x2");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
