// The fused MoE kernel with ping-pong 64 x 256 x 64 tiles in clusters of one, GEMM 1 reading w1 as
// the model stores it (FusedMoeArgs::w1_as_stored): kernel.cuh instantiated once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

const FusedEntry& fused_entry_64_c1_stored() {
  static const FusedEntry e = make_fused_entry<FusedGemm<64, true, 256, 1>>();
  return e;
}

}  // namespace uniep::cuda::megakernel
