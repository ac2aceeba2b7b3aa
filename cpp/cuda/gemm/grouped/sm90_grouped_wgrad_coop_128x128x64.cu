// The weight gradient x^T dy per expert on 128 x 128 tiles, for outputs of 128 columns or fewer.
#include "cuda/gemm/grouped/grouped_run.cuh"

namespace uniep::cuda::grouped {

const GroupedEntry& entry_wgrad_coop_128x128x64() {
  static const GroupedEntry e =
      make_entry<128, 128, 64, 1, 2, false, GroupedKind::kWgrad>("wgrad_coop_128x128x64");
  return e;
}

}  // namespace uniep::cuda::grouped
