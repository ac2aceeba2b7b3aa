// The fused MoE kernel with cooperative 128 x 256 x 64 tiles in clusters of two (experts of many
// rows): kernel.cuh instantiated once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

const FusedEntry& fused_entry_128() {
  static const FusedEntry e = make_fused_entry<FusedGemm<128>>();
  return e;
}

}  // namespace uniep::cuda::megakernel
