// Experiment: the ping-pong 64 x 256 tile on 2 x 2 clusters (A shared along N, B along M).
// Picked only through UNIEP_X_CLUSTER=2x2 (sm90_grouped_gemm.cu) until a measurement decides.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_x_pingpong_64x256x64_c2x2() {
  static const GroupedEntry e =
      make_entry<64, 256, 64, 2, 2, true>("x_pingpong_64x256x64_c2x2");
  return e;
}

}  // namespace uniep::cuda::grouped
