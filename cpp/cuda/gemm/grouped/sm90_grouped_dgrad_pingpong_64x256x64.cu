// The backward's data gradient dy w[e]^T on the forward's small-expert tile.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_dgrad_pingpong_64x256x64() {
  static const GroupedEntry e =
      make_entry<64, 256, 64, 2, 1, true, GroupedKind::kDgrad>("dgrad_pingpong_64x256x64");
  return e;
}

}  // namespace uniep::cuda::grouped
