// The cooperative 128 x 128 tile on clusters of two CTAs along N (they share each A tile): half
// the rows' padding of a 256-wide tile when N is small or not a multiple of 256.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_coop_128x128x64() {
  static const GroupedEntry e = make_entry<128, 128, 64, 1, 2, false>("coop_128x128x64");
  return e;
}

}  // namespace uniep::cuda::grouped
