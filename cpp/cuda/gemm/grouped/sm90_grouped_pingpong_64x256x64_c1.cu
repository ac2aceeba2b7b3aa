// The ping-pong 64 x 256 tile in clusters of one: experts of a few hundred rows or fewer, where a
// cluster of two would round each expert up to two row tiles (grouped_gemm_auto_cluster).
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_pingpong_64x256x64_c1() {
  static const GroupedEntry e = make_entry<64, 256, 64, 1, 1, true>("pingpong_64x256x64_c1");
  return e;
}

}  // namespace uniep::cuda::grouped
