// The weight gradient with ping-pong 64 x 256 tiles: small experts give the weight gradient a
// short K (the expert's rows), so each tile's epilogue is a large share of its time; here one
// warpgroup's epilogue runs under the other's mainloop. No split-K: the bits are the other
// configurations'.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_wgrad_pingpong_64x256x64() {
  static const GroupedEntry e =
      make_entry<64, 256, 64, 2, 1, true, GroupedKind::kWgrad>("wgrad_pingpong_64x256x64");
  return e;
}

}  // namespace uniep::cuda::grouped
