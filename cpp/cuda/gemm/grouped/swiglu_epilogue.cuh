// The grouped GEMM's SwiGLU epilogue: out[m, j] = silu(gate[m, j]) * up[m, j] straight from the
// fp32 accumulators of the first expert GEMM, so the [R, 2I] product never reaches memory.
//
// Why a layout of w1's columns: the pair (gate j, up j) must sit in one thread's accumulators.
// A WGMMA accumulator gives each thread two adjacent columns in every block of 8 across the
// tile, so any layout that alternates gate and up in blocks of 8 columns or a multiple of 8 puts
// each pair in one thread. kPair is that block width:
//   8   w1 packed by pack_gate_up (include/uniep/cuda/grouped_gemm.hpp): columns [16b, 16b + 8)
//       hold gate j = 8b..8b+7 and [16b + 8, 16b + 16) up for the same j;
//   64  w1 as stored (gate columns, then up), read by PlainGateUpMainloop as if packed in blocks
//       of 64 (gate_up_mainloop.cuh), with no copy of w1.
// Every thread writes act for two adjacent columns with one 4-byte store
// (DirectStoreEpilogue::store_swiglu).
//
// Numerics are those of the unfused chain and of the CPU executor: gate and up rounded to bf16
// (where the chain stored h), silu(g) * u in fp32, rounded once to bf16; the same bits for
// either layout, since each accumulator is the same fp32 sum over K.
//
// The interface CUTLASS asks of it is DirectStoreEpilogue's, its per-tile call DirectTileCall's
// (direct_epilogue.cuh).
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/megakernel/tile_gate.cuh"

namespace uniep::cuda::grouped {

template <int kPair = 8>
class SwiGluEpilogue : public DirectStoreEpilogue, public DirectTileCall<SwiGluEpilogue<kPair>> {
 public:
  // ld_out: I; done (optional): what the MegaKernel's second GEMM waits on
  // (docs/megakernel.md).
  using Arguments = DirectOutArguments;
  using Params = Arguments;

  CUTLASS_HOST_DEVICE explicit SwiGluEpilogue(const Params& params) : params_(params) {}

  template <int kAtom, class Tile, class Acc>
  CUTLASS_DEVICE void store_tile(const Tile& t, const Acc& acc) {
    auto* out = reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[t.group]);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < cute::size(acc); i += kAtom)
      store_swiglu<kPair, kAtom>(acc, t.crd, i, t.M, t.N, out, params_.ld_out);
    signal_tile_done(params_.done, params_.done_base, t.group, t.m_tile, t.tile_m, t.M,
                     params_.num_done);
  }

 private:
  Params params_;
};

}  // namespace uniep::cuda::grouped
