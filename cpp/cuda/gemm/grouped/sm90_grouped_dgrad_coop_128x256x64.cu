// The backward's data gradient dy w[e]^T (w[e]^T K-major) on the forward's large-expert tile.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_dgrad_coop_128x256x64() {
  static const GroupedEntry e =
      make_entry<128, 256, 64, 2, 1, false, GroupedKind::kDgrad>("dgrad_coop_128x256x64");
  return e;
}

}  // namespace uniep::cuda::grouped
