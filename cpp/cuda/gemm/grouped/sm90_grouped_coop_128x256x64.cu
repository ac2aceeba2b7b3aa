// The cooperative 128 x 256 tile on clusters of two CTAs along M (they share each B tile through
// TMA multicast): the most work per byte loaded, for experts of a few hundred rows and more.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_coop_128x256x64() {
  static const GroupedEntry e = make_entry<128, 256, 64, 2, 1, false>("coop_128x256x64");
  return e;
}

}  // namespace uniep::cuda::grouped
