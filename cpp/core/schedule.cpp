#include <algorithm>

#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace uniep {

std::vector<WorkTile> schedule_expert_tiles(const ExpertPlan& plan,
                                            const std::vector<int64_t>& source_offsets,
                                            const TuningParams& tuning, const MoeShape& shape) {
  shape.validate();
  const int64_t W = shape.world_size, El = plan.num_local_experts, tm = tuning.tile_m_or_default();
  UNIEP_CHECK(tm >= 1, "tuning.tile_m must be >= 1 (0: auto), got ", tm);
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

std::vector<int32_t> gate_tile_base(const int32_t* offs, int64_t num_experts, int64_t rows,
                                    int64_t tile_m) {
  UNIEP_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  UNIEP_CHECK(rows >= 0 && rows < (int64_t{1} << 31), "rows must be in [0, 2^31), got ", rows);
  UNIEP_CHECK(tile_m >= 1, "tile_m must be >= 1, got ", tile_m);
  std::vector<int32_t> base(static_cast<size_t>(num_experts) + 1);
  int64_t end = 0, tiles = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    base[e] = static_cast<int32_t>(tiles);
    const int64_t begin = end;
    end = std::max(end, std::min<int64_t>(std::max<int64_t>(offs[e], 0), rows));
    // ceil((end - begin) / tile_m) without forming end - begin + tile_m - 1, which wraps for a
    // tile_m near INT64_MAX.
    if (end > begin) tiles += (end - begin - 1) / tile_m + 1;
  }
  base[num_experts] = static_cast<int32_t>(tiles);
  return base;
}

ExpertTiles expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts,
                         int64_t tile_m) {
  UNIEP_CHECK(num_experts >= 1 && num_experts <= (int64_t{1} << 30),
              "num_experts must be in [1, 2^30], got ", num_experts);
  UNIEP_CHECK(entries >= 0 && entries < (int64_t{1} << 31),
              "topk_idx must have fewer than 2^31 entries (offs are int32), got ", entries);
  UNIEP_CHECK(entries == 0 || topk_idx != nullptr, "topk_idx must not be null");
  ExpertTiles out;
  out.counts.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t i = 0; i < entries; ++i)
    if (topk_idx[i] >= 0 && topk_idx[i] < num_experts) ++out.counts[topk_idx[i]];
  out.offs.resize(out.counts.size());
  int64_t end = 0;
  for (size_t e = 0; e < out.counts.size(); ++e)
    out.offs[e] = static_cast<int32_t>(end += out.counts[e]);
  out.tile_base = gate_tile_base(out.offs.data(), num_experts, entries, tile_m);
  return out;
}

}  // namespace uniep
