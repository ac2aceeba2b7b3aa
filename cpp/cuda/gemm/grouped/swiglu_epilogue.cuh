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
// The interface CUTLASS asks of it is DirectStoreEpilogue's (direct_epilogue.cuh).
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include "cuda/gemm/grouped/direct_epilogue.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/megakernel/tile_gate.cuh"

namespace uniep::cuda::grouped {

// kStaged (experiment; w1 packed in blocks of 64 and 128-column tiles, so a warpgroup's 64 rows
// hold 64 activation columns, 128 bytes a row): each warpgroup stages its rows in shared memory
// and one bulk copy (cp.async.bulk) a row stores 128 whole bytes, instead of 4-byte stores that
// each fill half a sector.
template <int kPair = 8, bool kStaged = false>
class SwiGluEpilogue : public DirectStoreEpilogue {
 public:
  static constexpr int kStagedRows = 64;      // a warpgroup's rows
  static constexpr int kStagedPitch = 144;    // 128 bytes + 16: rows 4 banks apart
  struct StagedStorage {
    alignas(128) uint8_t rows[2][kStagedRows * kStagedPitch];  // per consumer warpgroup
  };
  using SharedStorage = cute::conditional_t<kStaged, StagedStorage, DirectStoreEpilogue::SharedStorage>;
  struct Arguments {
    Bf16** ptr_out = nullptr;  // per group: row 0 of its rows of out
    int64_t ld_out = 0;        // elements between rows of out (I)
    // Optional (the MegaKernel's second GEMM waits on it, docs/megakernel.md): once a warp has
    // written its part of output tile (expert e, m-tile i), it adds 1 to
    // done[done_base[e] + i], so the tile's activation rows are complete at
    // (consumer warps per tile) x (N-tiles) arrivals. Null: no signal.
    uint32_t* done = nullptr;
    const int32_t* done_base = nullptr;
    int64_t num_done = 0;  // entries of done; a tile outside them is not signalled
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(const ProblemShape&, const Arguments& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const Arguments& args) {
    return args.ptr_out != nullptr && args.ld_out > 0 && args.ld_out % 2 == 0;
  }

  CUTLASS_HOST_DEVICE explicit SwiGluEpilogue(const Params& params) : params_(params) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 const cute::Tensor<FrgEngine, FrgLayout>& acc, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem) {
    using namespace cute;
    constexpr int kAtom = size<0>(FrgLayout{});
    const int M = get<0>(problem_shape_mnkl);
    const int N = get<1>(problem_shape_mnkl);
    const auto m_coord = get<0>(blk_coord_mnkl);
    const auto l_coord = get<3>(blk_coord_mnkl);
    Tensor crd = fragment_coords<FrgLayout>(problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl,
                                            tiled_mma, thread_idx);
    auto* out = reinterpret_cast<__nv_bfloat16*>(params_.ptr_out[l_coord]);
    if constexpr (kStaged) {
      static_assert(kPair == 64, "staged rows need w1 packed in blocks of 64");
      static_assert(decltype(size<1>(blk_shape_mnk))::value == 128,
                    "staged rows need 128-column tiles (64 activation columns)");
      store_staged<kAtom>(acc, crd, M, N, out, params_.ld_out, smem);
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); i += kAtom)
        store_swiglu<kPair, kAtom>(acc, crd, i, M, N, out, params_.ld_out);
    }
    if constexpr (kStaged) {
      // A waiter reads these rows: the copies must have written them, not only read the buffer.
      if (params_.done != nullptr) {
        if (threadIdx.x % 128 < kStagedRows) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
        __syncwarp();
      }
    }
    signal_tile_done(params_.done, params_.done_base, static_cast<int>(l_coord),
                     static_cast<int>(m_coord), size<0>(blk_shape_mnk), M, params_.num_done);
  }

 private:
  template <int kAtom, class Acc, class Crd>
  CUTLASS_DEVICE static void store_staged(const Acc& acc, const Crd& crd, int M, int N,
                                          __nv_bfloat16* out, int64_t ld, char* smem) {
    using namespace cute;
    // Consumer warpgroups 1 and 2 (warpgroup 0 loads); each owns 64 rows of output.
    const int wg = static_cast<int>(threadIdx.x) / 128 - 1;
    const int t = static_cast<int>(threadIdx.x) % 128;
    uint8_t* buf = reinterpret_cast<StagedStorage*>(smem)->rows[wg];
    const uint32_t bar = 8 + wg;  // after CUTLASS's reserved named barriers
    // This warpgroup's first row and first activation column: fragment value 0's, rounded down.
    const auto c0 = crd(0);
    const int m0 = get<0>(c0) - get<0>(c0) % kStagedRows;
    const int n0 = get<1>(c0);
    const int64_t j0 = (n0 / (2 * kPair)) * kPair;
    // The previous tile's copies have read the buffer (the issuing lanes wait; the barrier
    // passes that on).
    if (t < kStagedRows) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(acc); i += kAtom) {
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h) {
        CUTLASS_PRAGMA_UNROLL
        for (int v = 2 * h; v < kAtom; v += 4) {
          if ((v / 4) / (kPair / 8) % 2 != 0) continue;  // an up block
          const auto c = crd(i + v);
          const int r = get<0>(c) - m0, n = get<1>(c);
          const int j = n % kPair;  // within the tile's 64 activation columns
          *reinterpret_cast<uint32_t*>(buf + r * kStagedPitch + 2 * j) =
              pack(swiglu(acc(i + v), acc(i + v + kPair / 2)),
                   swiglu(acc(i + v + 1), acc(i + v + 1 + kPair / 2)));
        }
      }
    }
    // The generic-proxy stores, visible to the bulk copies' async proxy; then a row a lane.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("bar.sync %0, 128;" ::"r"(bar) : "memory");
    if (t < kStagedRows) {
      if (m0 + t < M && n0 < N) {
        const uint32_t src =
            static_cast<uint32_t>(__cvta_generic_to_shared(buf + t * kStagedPitch));
        __nv_bfloat16* dst = out + static_cast<int64_t>(m0 + t) * ld + j0;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 128;" ::"l"(dst),
                     "r"(src)
                     : "memory");
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // Before the CTA can exit (CUTLASS's TMA store epilogue waits as much at its tail).
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
  }

  Params params_;
};

}  // namespace uniep::cuda::grouped
