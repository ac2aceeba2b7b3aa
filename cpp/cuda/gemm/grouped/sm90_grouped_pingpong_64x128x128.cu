// The ping-pong 64 x 128 tile, k-step 128: each consumer warpgroup its own tile, one's epilogue
// under the other's mainloop; for experts of at most a few hundred rows (many small experts).
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_pingpong_64x128x128() {
  static const GroupedEntry e = make_entry<64, 128, 128, 2, 1, true>("pingpong_64x128x128");
  return e;
}

}  // namespace uniep::cuda::grouped
