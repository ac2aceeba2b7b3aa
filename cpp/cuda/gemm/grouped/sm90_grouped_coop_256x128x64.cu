// The cooperative 256 x 128 tile (each consumer warpgroup 128 rows), clusters of two along M:
// for experts of thousands of rows, where B traffic dominates.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_coop_256x128x64() {
  static const GroupedEntry e = make_entry<256, 128, 64, 2, 1, false>("coop_256x128x64");
  return e;
}

}  // namespace uniep::cuda::grouped
