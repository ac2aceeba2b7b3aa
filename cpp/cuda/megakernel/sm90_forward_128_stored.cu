// The fused MoE kernel with cooperative 128 x 256 x 64 tiles in clusters of two,
// GEMM 1 reading w1 as the model stores it (gate columns, then up; FusedMoeArgs::w1_as_stored):
// kernel.cuh instantiated once.
#include "cuda/megakernel/kernel.cuh"
#include "cuda/megakernel/launch.hpp"

namespace uniep::cuda::megakernel {

const FusedEntry& fused_entry_128_stored() {
  static const FusedEntry e = make_fused_entry<FusedGemm<128, true>>();
  return e;
}

}  // namespace uniep::cuda::megakernel
