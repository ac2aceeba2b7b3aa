// A CUTLASS ptr-array mainloop whose producer waits at a tile gate (tile_gate.cuh) before it
// loads a tile's A rows: how the MegaKernel's GEMMs start on the first tiles whose rows have
// arrived instead of after the whole dispatch (docs/megakernel.md).
//
// Why a wrapper and not our own kernel: the warp-specialized kernels (GemmUniversal's ptr-array
// cooperative and ping-pong kernels) reach the mainloop only through its collective interface:
// the producer warp calls tensormaps_perform_update(..., batch) whenever it moves to another
// group and load(..., blk_coord, ...) once per output tile. Hiding those two members is enough
// to gate every tile (the first is the engine's GroupTrackingMainloop, group_mainloop.cuh, which
// remembers the group and its rows), and the pipeline, the WGMMA consumers and the tile scheduler
// stay CUTLASS's own. The gate is read by the producer only: the consumers wait on the pipeline's
// barriers as always, so a gated tile costs the consumers nothing but the time the rows take.
//
// The wait sits before the TMA loads of the tile's first k-block; B (the expert's weight) is
// loaded in the same TMA transaction, so neither operand of a tile is read early.
//
// Two gates: the fused kernel runs both expert GEMMs as one grouped GEMM (groups [0, split) GEMM
// 1, [split, 2 split) GEMM 2), and the second half waits on GEMM 1's done counters (gate2, with
// expert = group - split) where the first waits on the dispatch's rows (gate).
#pragma once

#include <cute/tensor.hpp>

#include <climits>

#include "cuda/common/cta_index.cuh"
#include "cuda/gemm/grouped/group_mainloop.cuh"
#include "cuda/megakernel/tile_gate.cuh"

namespace uniep::cuda::megakernel {

// The gate on rows that a send stores (the MegaKernel's first GEMM, the backward's two): each
// stored row counts 1 on its tile's counter, so a tile may load once all of its rows are in.
inline TileGate stored_rows_gate(const uint32_t* counters, int64_t num_counters,
                                 const int32_t* tile_base, uint64_t timeout_ns,
                                 GateTimeout* timeout) {
  TileGate g;
  g.counters = counters;
  g.num_counters = num_counters;
  g.tile_base = tile_base;
  g.per_row = 1;
  g.per_tile = 0;
  g.timeout_ns = timeout_ns;
  g.timeout = timeout;
  return g;
}

template <class Base, int TileM>
struct GatedMainloop : grouped::GroupTrackingMainloop<Base> {
  using Tracking = grouped::GroupTrackingMainloop<Base>;
  struct Arguments : Base::Arguments {
    TileGate gate;
    TileGate gate2;
    int32_t split = INT_MAX;
    unsigned long long* stamps = nullptr;
  };
  struct Params : Base::Params {
    TileGate gate;
    TileGate gate2;
    int32_t split = INT_MAX;
    unsigned long long* stamps = nullptr;  // FusedMoeArgs::tile_stamps
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, const Arguments& args,
                                        void* workspace) {
    Params p = Tracking::template base_params<Params>(problem_shapes, args, workspace);
    p.gate = args.gate;
    p.gate2 = args.gate2;
    p.split = args.split;
    p.stamps = args.stamps;
    return p;
  }

  template <class TensorA, class TensorB, class TensorMapA, class TensorMapB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(const Params& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState smem_pipe_write,
                           const cute::tuple<TensorA, TensorB>& load_inputs,
                           const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps,
                           const BlockCoord& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                           int thread_idx, uint32_t block_rank_in_cluster,
                           typename Base::TensorStorage& shared_tensors) {
    const bool second = this->group_ >= params.split;
    const TileGate& gate = second ? params.gate2 : params.gate;
    if (gate_active(gate) && k_tile_count > 0) {
      if (cute::elect_one_sync()) {
        const uint64_t reached = params.stamps != nullptr ? global_timer_ns() : 0;
        gate_wait(gate, second ? this->group_ - params.split : this->group_,
                  static_cast<int>(cute::get<0>(blk_coord)), this->group_rows_, TileM);
        fence_generic_to_async();
        stamp_gate(params, reached);
      }
      __syncwarp();
    }
    Base::load(params, pipeline, smem_pipe_write, load_inputs, input_tensormaps, blk_coord,
               k_tile_iter, k_tile_count, thread_idx, block_rank_in_cluster, shared_tensors);
  }

 private:
  // FusedMoeArgs::tile_stamps: the first gated tile's (reached, opened), then the last one's.
  CUTLASS_DEVICE static void stamp_gate(const Params& params, uint64_t reached) {
    if (params.stamps == nullptr) return;
    unsigned long long* s = params.stamps + 6 * cta_linear_index();
    const int at = s[0] == 0 ? 0 : 2;
    s[at] = reached;
    s[at + 1] = global_timer_ns();
  }
};

}  // namespace uniep::cuda::megakernel
