// Tile gates: the readiness counters through which one part of the MoE MegaKernel tells another
// that a tile's inputs are in memory (docs/megakernel.md). A grouped GEMM run with a gate waits,
// before its producer loads the A rows of output tile (expert e, m-tile i), until
//
//     counters[tile_base[e] + i] >= per_row * rows_in_tile + per_tile
//
// where rows_in_tile = min(tile_m, M_e - i * tile_m). A dispatch that bumps a tile's counter once
// per row it has stored (per_row = 1, per_tile = 0) releases the tile when its last row lands; an
// epilogue that bumps it once per warp and N-tile it finished (per_row = 0, per_tile = warps x
// N-tiles) releases it when the whole row block of the previous GEMM is written.
//
// Counters only grow within a call; whoever owns them zeroes them between calls. Waits are
// bounded: past the deadline the first timed-out tile is recorded in `timeout` and the GEMM goes
// on (its output is then garbage, and the caller raises the recorded timeout instead of
// returning it), so a rank that never arrives gives an error naming the tile, not a hang.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

// Written by the device when a gated wait gives up (host-mapped or device memory, zeroed by the
// caller before the launch); the fields describe the first one.
//   flag 1  the wait timed out: have = the counter then, need = what the tile needed
//   flag 2  the tile's counter lies outside the gate's counters (too few for the row ranges):
//           have = num_counters, need = the counter's index; nothing was read
//   flag 3  the fused kernel's reduce (fused_moe.hpp) timed out on a token's expert row:
//           expert = the token, m_tile = its k, have / need as for flag 1
//   flag 4  the fused kernel's count exchange across ranks (fused_ep.hpp) timed out: expert =
//           the rank that never announced the call, have = its last epoch, need = this call's
struct GateTimeout {
  uint32_t flag = 0;
  int32_t expert = -1;  // the group (local expert) of the tile
  int32_t m_tile = -1;  // its m-tile within the expert
  uint32_t have = 0;
  uint32_t need = 0;
};

struct TileGate {
  const uint32_t* counters = nullptr;  // one per (expert, m-tile); null: no gate
  int64_t num_counters = 0;            // entries of counters (tile_base[E] are used)
  const int32_t* tile_base = nullptr;  // [E + 1] first counter of each expert (gate_tile_base)
  uint32_t per_row = 0, per_tile = 0;  // what one tile needs, as above
  // The other kind of gate (with counters null): one 64-bit word per group, ready[e] (device
  // memory; ready[e] null: the group waits for nothing), and every tile of group e loads once
  // *ready[e] >= epoch. The collectives' arrival words, which hold the epoch of the last call
  // whose rows landed, gate the all-gather + GEMM this way (part_gemm.hpp).
  const uint64_t* const* ready = nullptr;
  uint64_t epoch = 0;
  uint64_t timeout_ns = 0;             // 0: wait forever (tests of the gate only)
  GateTimeout* timeout = nullptr;      // where a timed-out wait is recorded; required with counters
  // Optional (null: none), for tuning: the ns each CTA waited, added at
  // waited_ns[waited_stride x (CTA's linear index)].
  unsigned long long* waited_ns = nullptr;
  int waited_stride = 1;
};

// tile_base[e] = sum over e' < e of ceil(M_e' / tile_m) for the row ranges in offs (cumulative
// row ends, clamped to [0, rows] as the grouped GEMM clamps them), tile_base[E] the total: the
// counters a gate over these experts needs. One warp, on the device, no host sync.
Status gate_tile_base(const int32_t* offs, int64_t num_experts, int64_t rows, int tile_m,
                      int32_t* tile_base, cudaStream_t stream);

// uniep::expert_tiles (include/uniep/plan.hpp) on the device, no host sync: counts [E] int64,
// offs [E] int32 and tile_base [E + 1] int32 from topk_idx's `entries` int64 ids, in one memset
// of the workspace and one launch. It replaces the count (a scatter-add), its prefix sum and
// gate_tile_base, whose ten launches sat before every local MegaKernel call. entries < 2^31,
// tile_m in [1, 2^20]; the workspace (device memory, any contents) of at least
// expert_tiles_workspace_bytes(num_experts) is the call's until the stream has run it.
size_t expert_tiles_workspace_bytes(int64_t num_experts);
Status expert_tiles(const int64_t* topk_idx, int64_t entries, int64_t num_experts, int tile_m,
                    int64_t* counts, int32_t* offs, int32_t* tile_base, void* workspace,
                    size_t workspace_bytes, cudaStream_t stream);

// What a gated GEMM with the SwiGLU epilogue tells the next GEMM: once a warp has written its part
// of output tile (expert e, m-tile i) it adds 1 to done[done_base[e] + i]. A tile is complete at
// kGatedWarpsPerTile x ceil(n / kGatedTileN) arrivals (n = 2 x FFN, the first GEMM's width),
// which is the per_tile of the second GEMM's gate.
struct GatedSignal {
  uint32_t* done = nullptr;  // null: no signal
  const int32_t* done_base = nullptr;
  int64_t num_done = 0;  // entries of done; a tile outside them is not signalled (its waiter
                         // then times out naming it)
};

// The gated GEMM's one configuration: the engine's cooperative 128 x 256 x 64 tiles (clusters
// of two CTAs along M). Its gates and signals count tiles of kGatedTileM rows.
constexpr int kGatedTileM = 128;
constexpr int kGatedTileN = 256;
constexpr int kGatedWarpsPerTile = 8;  // two consumer warpgroups share a tile

// Bytes of workspace grouped_gemm_gated_bf16 needs (either epilogue); 0 for num_experts < 1 or
// sm_count < 1.
size_t grouped_gemm_gated_workspace_bytes(int64_t num_experts, int sm_count);

// grouped_gemm_bf16's forward (kind kForward, epilogue kStore, kSwiGlu or kSwiGluPlain, the same
// checks and the same bits; kSwiGluPlain needs the FFN size n / 2 to be a multiple of kGatedTileN /
// 2) with the producer waiting at `gate` before each tile's loads (gate.counters null: no wait),
// and for the SwiGLU epilogues the done signal. The grid is persistent: a gate released by work on
// the same device needs that work to have SMs of its own (sm_count below the device's), or to run
// inside the same kernel, as the MegaKernel's dispatch does.
Status grouped_gemm_gated_bf16(const GroupedGemmProblem& p, const TileGate& gate,
                               const GatedSignal& signal, int device, int sm_count,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Raises (as Status) a recorded timeout or missing counter, naming the tile; OK when none.
inline Status gate_timeout_status(const GateTimeout& t, const char* what) {
  if (t.flag == 0) return Status::Ok();
  if (t.flag == 2)
    return {StatusCode::kInvalidArgument,
            detail::str_cat(what, ": counters holds ", t.have, " entries, but expert ", t.expert,
                            ", m-tile ", t.m_tile, " needs entry ", t.need,
                            " (size counters by gate_tile_base's last entry)")};
  if (t.flag == 3)
    return {StatusCode::kTimeout,
            detail::str_cat(what, ": the expert output of token ", t.expert, ", k = ", t.m_tile,
                            " never arrived (its tile's counter reached ", t.have, " of ", t.need,
                            ")")};
  if (t.flag == 4)
    return {StatusCode::kTimeout,
            detail::str_cat(what, ": rank ", t.expert, " never joined the count exchange of call ",
                            t.need, " (its last call was ", t.have,
                            "); every rank of the group must make the same calls")};
  return {StatusCode::kTimeout,
          detail::str_cat(what, ": the rows of expert ", t.expert, ", m-tile ", t.m_tile,
                          " never arrived (its counter reached ", t.have, " of ", t.need, ")")};
}

}  // namespace uniep::cuda
