// Experiment: the fp8 cooperative 128 x 128 tile on the pipelined mainloop
// (fp8_pipelined_mainloop.cuh), picked only through UNIEP_X_FP8_PIPE=1.
#include "cuda/gemm/grouped/fp8_kernel.cuh"

namespace uniep::cuda::grouped_fp8 {

const Entry& entry_x_coop_128x128x128_pipelined() {
  static const Entry e = make_entry<128, 1, 2, false, true>("x_fp8_coop_128x128x128_pipelined");
  return e;
}

}  // namespace uniep::cuda::grouped_fp8
