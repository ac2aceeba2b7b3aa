// The grouped GEMM's store epilogue with a done signal: D = the fp32 accumulators rounded once to
// bf16 (the TMA store epilogue's bits), stored straight from the accumulators into each group's
// rows, and once a warp has stored its part of output tile (group g, m-tile i) it adds 1 to
// done[done_base[g] + i] (SwiGluEpilogue's signal, at system scope). A row block is then whole
// at kGatedWarpsPerTile x (its n-tiles) arrivals, which whoever sends it on waits for: the
// GEMM + reduce-scatter's copy-engine pushes wait for their part this way (a stream wait on the
// counter), so each partial leaves as soon as its tiles are stored, not after the whole GEMM.
//
// Why not the TMA store: its bulk stores complete asynchronously, so a signal would first wait
// for them (tma_store_wait) inside CUTLASS's collective; direct stores are ordered before the
// release by the warp barrier. Two adjacent columns make one 4-byte store, as the SwiGLU
// epilogue's.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::grouped {

class SignalStoreEpilogue : public DirectStoreEpilogue, public DirectTileCall<SignalStoreEpilogue> {
 public:
  using Arguments = DirectOutArguments;  // ld_out: N
  using Params = Arguments;

  CUTLASS_HOST_DEVICE explicit SignalStoreEpilogue(const Params& params) : params_(params) {}

  template <int kAtom, class Tile, class Acc>
  CUTLASS_DEVICE void store_tile(const Tile& t, const Acc& acc) {
    auto* out = reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[t.group]);
    // A fragment holds two adjacent columns of every 8-column block (values v, v + 1 for even
    // v), in two row halves.
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc); i += kAtom) {
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < kAtom; v += 2) {
        const auto c = t.crd(i + v);
        const int m = cute::get<0>(c), n = cute::get<1>(c);
        if (m >= t.M || n >= t.N) continue;
        *reinterpret_cast<uint32_t*>(out + m * params_.ld_out + n) =
            pack(acc(i + v), acc(i + v + 1));
      }
    }
    signal_tile_done(params_.done, params_.done_base, t.group, t.m_tile, t.tile_m, t.M,
                     params_.num_done, /*system=*/true);
  }

 private:
  Params params_;
};

}  // namespace uniep::cuda::grouped
