// The backward's data gradient dy w[e]^T on the small-expert tile in clusters of one: its rows
// are the forward's, so a cluster of two would round each expert up to two row tiles there too
// (grouped_gemm_auto_cluster).
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_dgrad_pingpong_64x256x64_c1() {
  static const GroupedEntry e =
      make_entry<64, 256, 64, 1, 1, true, GroupedKind::kDgrad>("dgrad_pingpong_64x256x64_c1");
  return e;
}

}  // namespace uniep::cuda::grouped
