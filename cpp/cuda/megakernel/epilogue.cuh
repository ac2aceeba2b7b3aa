// The fused MoE kernel's epilogue: one grouped GEMM runs both expert GEMMs (groups [0, split)
// are GEMM 1 of each expert, groups [split, 2 split) GEMM 2), so the epilogue depends on the
// group:
//   GEMM 1  act = silu(gate) * up from the accumulators (the SwiGLU epilogue's arithmetic,
//           swiglu_epilogue.cuh), then each warp adds 1 to done1[tile] of its output tile;
//   GEMM 2  y = acc rounded once to bf16 (the bits of the TMA store epilogue), then each warp
//           adds 1 to done2[tile], which the reduce of the tokens waits on (at the warp's next
//           tile or after the GEMM body: see pending_). With peers each row goes straight to
//           its source rank's combine slot (row_src says which), so the outputs cross the links
//           while GEMM 2 runs, and the signal is released at system scope.
// Direct stores from the accumulator fragment, no shared memory: the fused kernel keeps all of it
// for the mainloop's stages. GEMM 2's lanes trade values by shuffles and store 16 bytes each;
// GEMM 1 stores 4 bytes (one gate/up pair) a time, as the engine's SwiGLU epilogue does. With
// GEMM 1 also on 16-byte stores, its tiles read 1.48 GB from DRAM on the Qwen3-like load where
// the engine's SwiGLU kernel reads 0.94 GB for the same tiles, and took 537 against 417 us (one
// H200, ncu, GEMM 1 launched alone through this kernel; 2026-11-27, commit e0f0345 with launch
// switches); with 4-byte stores 0.95 GB and 429 us, and the whole forward went from 1.48x to
// 1.37x the two GEMMs alone (commit 5ee0e1b). Why the wider stores cost reads is not
// established.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/detail.hpp>

#include "cuda/common/cta_index.cuh"
#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/tile_gate.cuh"

namespace uniep::cuda::megakernel {

// A consumer warp's slot among num_held (kFusedConsumerWarps per CTA), or -1 past them.
CUTLASS_DEVICE int64_t held_slot(int64_t num_held) {
  const int64_t cta = cta_linear_index();
  const int64_t slot =
      cta * kFusedConsumerWarps + (static_cast<int>(threadIdx.x) / 32 - kFusedProducerWarps);
  return slot >= 0 && slot < num_held ? slot : -1;
}

// kPair: GEMM 1's gate/up column blocks, 8 with w1 packed (pack_gate_up), 64 with w1 as stored
// read through PlainGateUpMainloop (swiglu_epilogue.cuh says why both pair up in one thread).
template <int kPair = 8>
class FusedMoeEpilogue : public grouped::DirectStoreEpilogue,
                         public grouped::DirectTileCall<FusedMoeEpilogue<kPair>> {
 public:
  using Bf16 = grouped::Bf16;

  struct Arguments {
    Bf16** ptr_out = nullptr;   // per group: row 0 of its output rows (act, then y)
    int64_t ld_act = 0;         // FFN: the columns of act
    int64_t ld_y = 0;           // hidden: the columns of y
    int32_t split = 0;          // groups below it are GEMM 1
    uint32_t* done1 = nullptr;  // per (expert, m-tile) at tile_base[e] + i
    uint32_t* done2 = nullptr;
    const int32_t* tile_base = nullptr;
    int64_t num_done = 0;       // entries of each of done1 and done2
    bool done2_system = false;  // done2 is read by peer GPUs: release at system scope
    // With peers (world > 1): GEMM 2's rows go to their sources' combine slots, not ptr_out.
    // Row r of local expert e is offs[e - 1] + m (offs[-1] = 0); row_src[r] = source rank x
    // slots + slot; the slot's row is combine_table[source] + slot x ld_y elements.
    int world = 1;
    const int32_t* offs = nullptr;
    const int64_t* row_src = nullptr;
    int64_t capacity = 0, slots = 0;
    void* const* combine_table = nullptr;
    // Set: done2 is the parity-0 set and the call signals the (*parity_epoch & 1)-th
    // (FusedMoeArgs::parity_epoch).
    const uint64_t* parity_epoch = nullptr;
    int64_t done2_parity_stride = 0;
    // Per (CTA, consumer warp), num_held of them: where store_tail leaves the warp's held-back
    // GEMM-2 signal for the kernel to give after the GEMM body (fused_moe_kernel). Null: each
    // signal is given right after its tile's stores.
    uint32_t** held = nullptr;
    int64_t num_held = 0;
    unsigned long long* stamps = nullptr;  // FusedMoeArgs::tile_stamps
  };
  using Params = Arguments;

  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const Arguments& a) {
    return a.ptr_out != nullptr && a.ld_act > 0 && a.ld_act % 2 == 0 && a.ld_y > 0 &&
           a.ld_y % 2 == 0 && a.split >= 0 && a.done1 != nullptr && a.done2 != nullptr &&
           a.tile_base != nullptr && a.num_done > 0;
  }

  CUTLASS_HOST_DEVICE explicit FusedMoeEpilogue(const Params& params) : params_(params) {}

  // One output tile (DirectTileCall's call).
  template <int kAtom, class Tile, class Acc>
  CUTLASS_DEVICE void store_tile(const Tile& t, const Acc& acc) {
    using namespace cute;
    static_assert(kAtom % 8 == 0, "column blocks must pair up (gate, up)");
    const int M = t.M, N = t.N, group = t.group;
    const auto& crd = t.crd;
    auto* out = reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[group]);
    const bool first = group < params_.split;
    const bool push = !first && params_.world > 1;
    RowCache rows;
    stamp(4);
    // The last tile's stores were issued a whole mainloop ago: its release no longer waits.
    signal_pending();

    // A warp whose rows of this tile all lie in its fragment's first row half (a decode step's
    // tiles of at most 8 rows, a tile's last rows, or no row at all) stores through
    // store_few_rows; the others through the unrolled store_all_rows.
    const bool few = __all_sync(0xffffffffu, get<0>(crd(2)) >= M);
    if (few)
      store_few_rows<kAtom>(t, acc, out, first, push, rows);
    else
      store_all_rows<kAtom>(t, acc, out, first, push, rows);
    if (first) {
      signal_tile_done(params_.done1, params_.tile_base, group, t.m_tile, t.tile_m, M,
                       params_.num_done);
      stamp(5);
      return;
    }
    uint32_t* done2 = params_.done2;
    if (params_.parity_epoch != nullptr)
      done2 += static_cast<int64_t>(*params_.parity_epoch & 1) * params_.done2_parity_stride;
    pending_ = tile_done_counter(done2, params_.tile_base, group - params_.split, t.m_tile,
                                 t.tile_m, M, params_.num_done);
    signal_pending(params_.held == nullptr);
    stamp(5);
  }

  // Called by store_tail: after every tile in the ping-pong body, once after the last in the
  // cooperative one. The signal stays held (the next tile's epilogue gives it); the slot says
  // which one the kernel gives after the body if no tile follows.
  CUTLASS_DEVICE void hand_over_pending() {
    const int64_t slot = held_slot(params_.num_held);
    const bool keep = params_.held != nullptr && slot >= 0;
    if (keep && threadIdx.x % 32 == 0) params_.held[slot] = pending_;
    signal_pending(!keep);
  }

  // Gives the held signal when `now`. The warp barrier is outside any branch: the compiler
  // cannot prove a value loaded from memory (tile_base, hence pending_) or the warp's slot uniform
  // across the warp, and a __syncwarp under such a branch made it treat the shuffles after it as
  // possibly divergent (some ninety collective fix-ups more in the kernel, and a slower forward).
  CUTLASS_DEVICE void signal_pending(bool now = true) {
    __syncwarp();
    if (!now) return;
    if (threadIdx.x % 32 == 0 && pending_ != nullptr)
      gate_signal_at(pending_, 1u, params_.done2_system);
    pending_ = nullptr;
  }

 private:
  // The last two rows this thread looked up: a thread's fragment covers two rows of the tile, so
  // each row's source is read once per tile, not once per store.
  // Two named entries, not arrays: a runtime index into an array would put it in local memory.
  struct RowCache {
    int m0 = -1, m1 = -1;
    __nv_bfloat16 *at0 = nullptr, *at1 = nullptr;
    bool second = false;  // which entry the next miss replaces
  };

  // Every value of the fragment, unrolled. A value pair is two adjacent bf16 columns of one row;
  // the four lanes of a row (lanes 4r..4r+3) hold the four pairs of each 8-column block. In
  // GEMM 2, four blocks at a time they trade pairs (a 4 x 4 transpose), so each lane stores one
  // whole block: one 16-byte store where there were four 4-byte ones, and whole sectors.
  template <int kAtom, class Tile, class Acc>
  CUTLASS_DEVICE void store_all_rows(const Tile& t, const Acc& acc, __nv_bfloat16* out, bool first,
                                     bool push, RowCache& rows) {
    using namespace cute;
    const int M = t.M, N = t.N;
    const auto& crd = t.crd;
    const int q = static_cast<int>(threadIdx.x % 4);
    constexpr int kBlocks = kAtom / 4;  // 8-column blocks of the atom
    static_assert(kBlocks % 4 == 0, "the transposes take the blocks four at a time");
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      if (first) {
        // One 4-byte store per pair of activation columns (see the file comment for why not
        // 16 bytes).
        store_swiglu<kPair, kAtom>(acc, crd, i, M, N, out, params_.ld_act);
        continue;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h) {
        CUTLASS_PRAGMA_UNROLL
        for (int quad = 0; quad < kBlocks / 4; ++quad) {
          uint32_t w[4];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 4; ++j) {
            const int v = 4 * (4 * quad + j) + 2 * h;
            w[j] = pack(acc(i + v), acc(i + v + 1));
          }
          transpose4(w, q);
          const auto c = crd(i + 4 * (4 * quad) + 2 * h);
          const int m = get<0>(c), n = get<1>(c) - 2 * q + 8 * q;  // lane q's block
          if (m < M && n < N) {
            __nv_bfloat16* row = y_row(t.group, m, out, push, rows);
            if (row != nullptr) store16(row + n, w);
          }
        }
      }
    }
  }

  // The warp's rows lie in the fragment's first row half only (h = 0 in the WGMMA fragment's
  // ((2 columns, 2 row halves, N/8 blocks), M, N)): a decode step's tiles of at most 8 rows, the
  // last rows of a tile, or no row at all. store_all_rows is about 74 KB of SASS on the 64 x 256
  // tile, which each such warp fetched to store one row or none: under Nsight Compute the
  // one-token step's epilogues spent 77% of their warps' samples waiting for instructions. Here
  // a warp with no row stores nothing, and the others walk the first half only, each atom's row
  // looked up once, GEMM 2's lanes storing their own pairs (4 bytes each) without the
  // transposes: 3.7 KB for GEMM 2, 8.7 KB for GEMM 1 (mostly the SwiGLU's arithmetic). On one
  // H200 (2026-12-03, 5d8edff with a switch between the two, CUDA graphs in one process) a
  // one-token step of 128 experts of FFN 768 took 45.6 against 49.7 us, 0.98-0.99x from 16 to
  // 64 tokens, and unchanged (0.99-1.00x) at 512 and 4096 tokens and on 256 experts of FFN 2048.
  // A rolled loop over a local copy of the fragment would be smaller still, but the copy's
  // registers made ptxas spill two of the mainloop's values, reloaded at every k-block.
  // The same values, rounded the same way: the same bits as store_all_rows.
  template <int kAtom, class Tile, class Acc>
  CUTLASS_DEVICE void store_few_rows(const Tile& t, const Acc& acc, __nv_bfloat16* out, bool first,
                                     bool push, RowCache& rows) {
    using namespace cute;
    const int M = t.M, N = t.N;
    const auto& crd = t.crd;
    if (__all_sync(0xffffffffu, get<0>(crd(0)) >= M)) return;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      // The first half's values of one atom lie on one row, at columns n0 + 8 b for its blocks
      // b (fragment_coords' layout): the row's place is looked up once.
      const int m = get<0>(crd(i)), n0 = get<1>(crd(i));
      if (m >= M) continue;
      if (first) {
        // The activation's column of gate column n0 + 8 b (store_swiglu's j), where the tile
        // starts at a multiple of 2 kPair columns (as store_swiglu's gate test assumes too).
        __nv_bfloat16* row = out + m * params_.ld_act + (n0 / (2 * kPair)) * kPair + n0 % kPair;
        constexpr int kUp = kPair / 2;  // fragment values from a gate value to its up value
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kAtom; v += 4) {
          const int b = v / 4;
          if (b / (kPair / 8) % 2 != 0 || n0 + 8 * b >= N) continue;  // an up block, or past N
          const int at = (8 * b / (2 * kPair)) * kPair + 8 * b % kPair;
          *reinterpret_cast<uint32_t*>(row + at) = pack(
              swiglu(acc(i + v), acc(i + v + kUp)), swiglu(acc(i + v + 1), acc(i + v + 1 + kUp)));
        }
        continue;
      }
      __nv_bfloat16* row = y_row(t.group, m, out, push, rows);
      if (row == nullptr) continue;
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kAtom; v += 4)  // block v / 4, at column n0 + 2 v
        if (n0 + 2 * v < N)
          *reinterpret_cast<uint32_t*>(row + n0 + 2 * v) = pack(acc(i + v), acc(i + v + 1));
    }
  }

  // tile_stamps[6 x CTA + at] = now, by the first thread of the warpgroup.
  CUTLASS_DEVICE void stamp(int at) const {
    if (params_.stamps != nullptr && threadIdx.x % 128 == 0)
      params_.stamps[6 * cta_linear_index() + at] = global_timer_ns();
  }

  // Among the four lanes of a row (lane % 4 = q): before, w[j] is this lane's pair of block j;
  // after, w[j] is lane j's pair of block q. Round s sends w[(q + s) % 4] to lane q + s and
  // receives lane q - s's pair of block q.
  CUTLASS_DEVICE static void transpose4(uint32_t (&w)[4], int q) {
    uint32_t out[4] = {0u, 0u, 0u, 0u};
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < 4; ++s) {
      const int send = (q + s) & 3, from = (q - s) & 3;
      const uint32_t mine = send == 0 ? w[0] : send == 1 ? w[1] : send == 2 ? w[2] : w[3];
      const uint32_t got = __shfl_sync(0xffffffffu, mine, (threadIdx.x & ~3u) | from);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j)
        if (j == from) out[j] = got;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) w[j] = out[j];
  }

  CUTLASS_DEVICE static void store16(__nv_bfloat16* at, const uint32_t (&w)[4]) {
    *reinterpret_cast<uint4*>(at) = make_uint4(w[0], w[1], w[2], w[3]);
  }

  // Where GEMM 2's row m of `group` goes: its source's combine slot (push; null as slot_row
  // says), else row m of out.
  CUTLASS_DEVICE __nv_bfloat16* y_row(int group, int m, __nv_bfloat16* out, bool push,
                                      RowCache& rows) const {
    return push ? slot_row(group - params_.split, m, rows) : out + m * params_.ld_y;
  }

  // Row m of local expert e's GEMM 2 in its source's combine slot, or null when the row lies past
  // the buffers or names no rank (a plan that failed, already reported).
  CUTLASS_DEVICE __nv_bfloat16* slot_row(int e, int m, RowCache& cache) const {
    if (m == cache.m0) return cache.at0;
    if (m == cache.m1) return cache.at1;
    const int64_t begin = e == 0 ? 0 : params_.offs[e - 1];
    const int64_t r = begin + m;
    __nv_bfloat16* at = nullptr;
    if (r >= 0 && r < params_.capacity) {
      // Stored by a peer's send during this kernel: from L2, where its stores land, not from a
      // line an earlier tile may have left in L1.
      const int64_t src = __ldcg(params_.row_src + r);
      const int64_t s = src / params_.slots, slot = src - s * params_.slots;
      if (src >= 0 && s < params_.world)
        at = static_cast<__nv_bfloat16*>(params_.combine_table[s]) + slot * params_.ld_y;
    }
    if (cache.second) {
      cache.m1 = m;
      cache.at1 = at;
    } else {
      cache.m0 = m;
      cache.at0 = at;
    }
    cache.second = !cache.second;
    return at;
  }

  Params params_;
  // This warp's GEMM-2 tile signal, given at its next tile's epilogue or at the end of the body
  // instead of right after the stores. A release waits until the warp's earlier stores are
  // performed, so right after 16-byte stores of a whole tile it held the warp about as long as
  // the stores took, once per tile. Only GEMM 2's: nothing in the GEMM body waits on them (the
  // reduce after it does), so the delay cannot close a cycle of waits. GEMM 1's signals release
  // GEMM-2 tiles, which may already be waiting on them: those go out at once. (Holding them while
  // the warp's next tile was surely a GEMM-1 tile measured the same, within the run-to-run
  // spread; one H200, 2026-11-28, commit 58f5ef1.)
  uint32_t* pending_ = nullptr;
};

// CUTLASS's adapter for an epilogue without a pipeline of its own, whose store_tail also hands
// the held-back GEMM-2 signal over (FusedMoeEpilogue::hand_over_pending).
template <class Op>
struct FusedEpilogueAdapter
    : cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Op> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<Op>;
  using Base::Base;

  template <class... Args>
  CUTLASS_DEVICE auto store_tail(Args... args) {
    this->hand_over_pending();
    return Base::store_tail(args...);
  }
};

// Lane 0 of each consumer warp after the GEMM body: gives the signal its warp still holds
// (FusedMoeEpilogue::held), which the reduce waits on.
CUTLASS_DEVICE void give_held_signal(uint32_t** held, int64_t num_held, bool system) {
  const int64_t slot = held_slot(num_held);
  __syncwarp();
  if (held == nullptr || slot < 0 || threadIdx.x % 32 != 0) return;
  if (uint32_t* counter = held[slot]; counter != nullptr) gate_signal_at(counter, 1u, system);
}

}  // namespace uniep::cuda::megakernel
