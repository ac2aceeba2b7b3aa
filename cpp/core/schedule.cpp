#include <algorithm>

#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace uniep {

std::vector<WorkTile> schedule_expert_tiles(const ExpertPlan& plan,
                                            const std::vector<int64_t>& source_offsets,
                                            const TuningParams& tuning, const MoeShape& shape) {
  const int64_t W = shape.world_size, El = plan.num_local_experts, tm = tuning.tile_m_or_default();
  UNIEP_CHECK(static_cast<int64_t>(source_offsets.size()) == El * (W + 1),
              "source_offsets must be [E_local, W + 1]");
  std::vector<WorkTile> tiles;
  auto emit = [&](int64_t e, int64_t s) {
    const int64_t begin = source_offsets[e * (W + 1) + s],
                  end = source_offsets[e * (W + 1) + s + 1];
    for (int64_t r = begin; r < end; r += tm) tiles.push_back({e, r, std::min(end, r + tm), s});
  };
  if (tuning.overlap == OverlapMode::kSequential) {
    for (int64_t e = 0; e < El; ++e)
      for (int64_t s = 0; s < W; ++s) emit(e, s);
  } else {
    // Own tokens need no network and land first; peers follow in the order they are written to.
    for (int64_t i = 0; i < W; ++i)
      for (int64_t e = 0; e < El; ++e) emit(e, (shape.rank + i) % W);
  }
  return tiles;
}

}  // namespace uniep
