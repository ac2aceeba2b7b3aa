// The plan every executor runs: who sends which token where, which receive slot it lands in,
// which slots each local expert reads, and where each expert output goes back to.
//
// Receive slots are ordered by (source rank, source token index), computed from exclusive prefix
// sums of counts that all ranks agree on, so the layout of every buffer is a function of the
// routing alone: never of arrival order, SM count or tile sizes.
//
// Every function here that takes a MoeShape validates it (MoeShape::validate), and the counts it
// indexes by (those the peers announced included): it throws uniep::Error naming the argument
// rather than read out of bounds.
#pragma once

#include <cstdint>
#include <vector>

#include "uniep/send_rows_error.hpp"
#include "uniep/shape.hpp"
#include "uniep/tuning.hpp"

namespace uniep {

// Computed by each rank from its own topk_idx only (the "notify" input).
struct RoutingLayout {
  std::vector<int64_t> tokens_per_rank;    // [W] tokens sent to each rank (once per rank)
  std::vector<int64_t> tokens_per_expert;  // [E] (token, k) pairs routed to each global expert
  std::vector<uint8_t> token_in_rank;      // [T * W] row-major: 1 if token t goes to rank r
};

// Throws if an expert id is outside [-1, E).
RoutingLayout compute_layout(const int64_t* topk_idx, const MoeShape& shape);

// Where this rank's tokens land on every destination, and which slots it receives.
struct SlotPlan {
  int64_t world_size = 1;
  int64_t rank = 0;
  std::vector<int64_t> send_offsets;  // [W + 1] ranges of send_tokens per destination
  std::vector<int64_t> send_tokens;   // source token ids grouped by destination, ascending
  std::vector<int64_t> send_slots;    // receive slot of each send_tokens entry on its destination
  std::vector<int64_t> recv_offsets;  // [W + 1] receive slots coming from each source rank

  int64_t num_send() const { return send_offsets.back(); }
  int64_t num_recv() const { return recv_offsets.back(); }
};

// rank_counts: [W][W] row-major, row s = tokens_per_rank of source rank s (all-gathered).
SlotPlan plan_slots(const RoutingLayout& layout, const int64_t* rank_counts, const MoeShape& shape);

// Grouped-GEMM rows of the local experts, each expert's rows in receive-slot order, and the
// combine slot (src_token * K + k on the source rank) each row's output is written to.
struct ExpertPlan {
  int64_t num_local_experts = 0;
  std::vector<int64_t> row_offsets;       // [E_local + 1]
  std::vector<int64_t> row_slot;          // [R] receive slot the row reads
  std::vector<int64_t> row_src_rank;      // [R]
  std::vector<int64_t> row_combine_slot;  // [R] src_token * K + k on row_src_rank
  std::vector<int64_t> return_counts;     // [W] rows sent back to each source rank

  int64_t num_rows() const { return row_offsets.back(); }
};

// recv_src_token [N]: source token index of each receive slot; recv_topk_idx [N, K]: its global
// expert ids (-1 unused). expert_counts: [W][E] row-major tokens_per_expert of every rank, used
// to check the received metadata against what the senders announced.
ExpertPlan plan_experts(const SlotPlan& slots, const int64_t* recv_src_token,
                        const int64_t* recv_topk_idx, const int64_t* expert_counts,
                        const MoeShape& shape);

// Per local expert and source rank, the row range that source's tokens occupy: known from the
// counts alone, before any token arrives. [E_local][W + 1] row-major, offsets into the rows.
std::vector<int64_t> expert_source_offsets(const int64_t* expert_counts, const MoeShape& shape);

// Where each of this rank's (token, k) rows lands as a grouped-GEMM row on its destination: the
// sender-side gather of the MegaKernel (docs/megakernel.md). Row (t, k) routed to global expert g
// of rank r goes to expert_source_offsets(r)[g - first(r)][me] + the number of (t', k') < (t, k)
// (token-major) of this rank routed to g: exactly the row plan_experts gives it on r, computed
// from this rank's routing and the agreed counts alone, before any token moves.
// The row's tile gate counter (include/uniep/cuda/tile_gate.hpp) on dest_rank: its expert's
// first counter there (gate_tile_base over that rank's row ranges, tiles of tile_m rows) plus
// the row's m-tile within the expert.
struct SenderRows {
  std::vector<int64_t> dest_rank;  // [T * K] -1 for an unused entry
  std::vector<int64_t> gemm_row;   // [T * K] the row on dest_rank, -1 for an unused entry
  std::vector<int64_t> counter;    // [T * K] the row's gate counter on dest_rank, -1 unused
  // The first failing entry, as the device records it (uniep/cuda/send_rows_error.hpp): an
  // expert id outside [-1, E), or more rows to an expert than this rank's own count says (the
  // counts are its announcement, so its routing must match them). Failing entries are left unused;
  // 0: none.
  uint64_t error = 0;
  // [T * K] this rank's entries in the order a send that overlaps the GEMMs stores them: by
  // (expert index on its rank, rank), each expert's in row order, at the position its announced
  // count gives it (expert_counts[rank] of the experts before it in that order), -1 elsewhere.
  // Every rank's first experts are complete first, the order in which the GEMMs take tiles.
  std::vector<int64_t> send_order;
};

// expert_counts: [W][E] row-major tokens_per_expert of every rank (all-gathered); each rank's
// rows must fit int32 (the grouped GEMM's row indices).
SenderRows plan_sender_rows(const int64_t* topk_idx, const int64_t* expert_counts,
                            const MoeShape& shape, int64_t tile_m);

// One unit of expert work: rows [row_begin, row_end) of local expert `expert`.
struct WorkTile {
  int64_t expert = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  int64_t src_rank = 0;  // all rows of a tile come from one source (the tile's signal)
};

// The order the expert role walks its tiles in. `sequential`: expert-major, after all tokens
// arrived. `chunked`/`fused`: in expected arrival order (own rank first, then rank+1, ...), so
// compute starts on the first tile that lands. Tiles never straddle a source rank.
std::vector<WorkTile> schedule_expert_tiles(const ExpertPlan& plan,
                                            const std::vector<int64_t>& source_offsets,
                                            const TuningParams& tuning, const MoeShape& shape);

// The tile counters of a gated grouped GEMM (include/uniep/cuda/tile_gate.hpp): base[e] = the
// number of tile_m-row tiles of experts before e, base[E] their total, for the row ranges of
// offs (cumulative row ends) after the grouped GEMM's clamp (each end into [0, rows] and to at
// least the largest earlier end). The CUDA executor computes the same on the device.
std::vector<int32_t> gate_tile_base(const int32_t* offs, int64_t num_experts, int64_t rows,
                                    int64_t tile_m);

// The plan a MegaKernel call on one rank needs before its send, from the routing alone:
// counts[e] = the entries of topk_idx equal to e (ids < 0 or >= num_experts count nowhere),
// offs[e] = counts[0] + ... + counts[e] (the grouped GEMM's row ends, int32) and tile_base =
// gate_tile_base(offs, entries, tile_m). The CUDA executor computes the same in a memset and
// one launch (include/uniep/cuda/tile_gate.hpp).
struct ExpertTiles {
  std::vector<int64_t> counts;
  std::vector<int32_t> offs, tile_base;
};
ExpertTiles expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts,
                         int64_t tile_m);

}  // namespace uniep
