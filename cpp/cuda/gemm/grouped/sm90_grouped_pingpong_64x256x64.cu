// The ping-pong 64 x 256 tile: small experts with a wide N, twice the B reuse of 64 x 128.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_pingpong_64x256x64() {
  static const GroupedEntry e = make_entry<64, 256, 64, 2, 1, true>("pingpong_64x256x64");
  return e;
}

}  // namespace uniep::cuda::grouped
