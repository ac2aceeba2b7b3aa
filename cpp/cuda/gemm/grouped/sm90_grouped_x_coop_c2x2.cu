// Experiment: the cooperative 128 x 256 tile on 2 x 2 clusters, so each A tile is shared along N
// and each B tile along M (half the L2 reads of a 2 x 1 cluster's A). Picked only through
// UNIEP_X_CLUSTER=2x2 (sm90_grouped_gemm.cu) until a measurement decides.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_x_coop_128x256x64_c2x2() {
  static const GroupedEntry e = make_entry<128, 256, 64, 2, 2, false>("x_coop_128x256x64_c2x2");
  return e;
}

}  // namespace uniep::cuda::grouped
