// coop_128x256x64 on single-CTA clusters: the odd last m-tile of each expert when the 2 x 1
// cluster configuration runs the tile pairs (grouped_problems.cuh), so no tile of padding is
// computed beside it. Not selectable on its own.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_coop_128x256x64_c1() {
  static const GroupedEntry e = make_entry<128, 256, 64, 1, 1, false>("coop_128x256x64_c1");
  return e;
}

}  // namespace uniep::cuda::grouped
