// The fused MoE kernel with ping-pong 64 x 128 x 64 tiles in clusters of one (decode: experts of a
// few rows, where the weight read is the cost): kernel.cuh instantiated once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

const FusedEntry& fused_entry_64_n128() {
  static const FusedEntry e = make_fused_entry<FusedGemm<64, false, 128, 1>>();
  return e;
}

}  // namespace uniep::cuda::megakernel
