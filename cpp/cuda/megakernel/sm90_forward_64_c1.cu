// The fused MoE kernel with ping-pong 64 x 256 x 64 tiles in clusters of one (experts of a few
// hundred rows or fewer, whose row tiles a cluster of two would pair): kernel.cuh instantiated
// once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

const FusedEntry& fused_entry_64_c1() {
  static const FusedEntry e = make_fused_entry<FusedGemm<64, false, 256, 1>>();
  return e;
}

}  // namespace uniep::cuda::megakernel
