// The fused MoE kernel with ping-pong 64 x 256 x 64 tiles in clusters of two (experts of a few
// hundred rows): kernel.cuh instantiated once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

const FusedEntry& fused_entry_64() {
  static const FusedEntry e = make_fused_entry<FusedGemm<64>>();
  return e;
}

}  // namespace uniep::cuda::megakernel
