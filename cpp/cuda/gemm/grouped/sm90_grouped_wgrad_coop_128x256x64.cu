// The backward's weight gradient x^T dy per expert (K = the expert's rows, reduced in ascending
// row order by one CTA per output tile: no split-K, so the bits do not depend on the grid).
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_wgrad_coop_128x256x64() {
  static const GroupedEntry e =
      make_entry<128, 256, 64, 2, 1, false, GroupedKind::kWgrad>("wgrad_coop_128x256x64");
  return e;
}

}  // namespace uniep::cuda::grouped
