// The fused MoE kernel (include/uniep/cuda/fused_moe.hpp) for one tile shape: CUTLASS's ptr-array
// GEMM body over 2E groups (GEMM 1 of every expert, then GEMM 2 of every expert), wrapped by the
// send before it (communication CTAs only) and the reduce after it. Included by
// sm90_forward_<tile_m>.cu, one instantiation each (they compile in parallel; launch.hpp
// declares what they define); the checks and the choice between them are in sm90_forward.cu.
//
// Two shapes, as the engine has them (grouped_kernel.cuh): 128 x 256 x 64 cooperative tiles (the
// two consumer warpgroups split a tile's rows) for experts of many rows, and 64 x 256 x 64
// ping-pong tiles (each warpgroup its own tile, one's epilogue under the other's mainloop) for
// experts of a few hundred rows, where 128-row tiles leave half a tile idle. Both in clusters of
// two along M. The gates count rows and done warps per tile of the kernel's own height, so the
// plan (sender_rows, gate_tile_base) is made for that tile_m.
//
// Why one grouped GEMM for both: the persistent scheduler walks the groups in order, so each CTA
// finishes its GEMM-1 tiles before it takes a GEMM-2 tile, and a GEMM-2 tile only waits on
// GEMM-1 tiles, which only wait on the send, which waits on nothing: with every CTA resident the
// waits cannot close a cycle. In the ping-pong kernel a CTA's two warpgroups take its tiles
// alternately, in the same order, and its producer loads them in that order, so the same holds.
// Two GEMM bodies in one kernel would need the pipelines' barriers torn down and rebuilt between
// them; one body needs nothing of the kind.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/cta_index.cuh"
#include "cuda/gemm/cutlass_launch.cuh"
#include "cuda/gemm/grouped/grouped_kernel.cuh"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/epilogue.cuh"
#include "cuda/megakernel/gated_mainloop.cuh"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/scheduler.cuh"
#include "cuda/megakernel/stages.cuh"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda::megakernel {

// W1AsStored: GEMM 1 reads w1 as the model stores it (gate columns, then up) through
// PlainGateUpMainloop instead of pack_gate_up's copy; the same bits. TileN 128 with ClusterM 1
// is the decode shape: experts of a few rows each, where the weight read is the whole cost and a
// second CTA per cluster would only compute padding, so twice the tiles stream weights at once.
template <int TileM, bool W1AsStored = false, int TileN = kGatedTileN, int ClusterM = 2>
struct FusedGemm {
  static_assert((TileM == 128 && TileN == 256 && ClusterM == 2) ||
                    (TileM == 64 && TileN == 256 && ClusterM == 2) ||
                    (TileM == 64 && TileN == 128 && ClusterM == 1),
                "the fused kernel's tiles are 128 x 256 or 64 x 256 in clusters of two, or "
                "64 x 128 in clusters of one");
  static constexpr int kTileM = TileM, kTileN = TileN, kClusterM = ClusterM;
  static constexpr bool kPingPong = TileM == 64;
  static constexpr bool kW1AsStored = W1AsStored;
  // Warps that write (and signal) one output tile: both consumer warpgroups, or one.
  static constexpr int kWarpsPerTile = kPingPong ? 4 : 8;
  // The SwiGLU configuration's mainloop: built with the stage count of an epilogue that keeps
  // no shared memory, which FusedMoeEpilogue also keeps none of.
  using Plain = grouped::Sm90GroupedGemm<TileM, kTileN, 64, ClusterM, 1, kPingPong,
                                         W1AsStored ? grouped::GroupedEpilogue::kSwiGluPlain
                                                    : grouped::GroupedEpilogue::kSwiGlu>;
  using Mainloop = GatedMainloop<typename Plain::Mainloop, TileM>;
  using Epilogue = FusedEpilogueAdapter<FusedMoeEpilogue<W1AsStored ? 64 : 8>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<FusedProblemShape, Mainloop, Epilogue>;
  static_assert(cute::is_same_v<typename Kernel::InternalStrideA, grouped::KMajorA>);
  static_assert(cute::is_same_v<typename Kernel::InternalStrideB, grouped::NMajorB>);
  static_assert(cute::is_same_v<typename Kernel::TileScheduler,
                                SkewedGroupScheduler<Kernel::TileSchedulerStages>>,
                "the fused kernel must run the skewed scheduler");
  static constexpr int kThreads = static_cast<int>(Kernel::MaxThreadsPerBlock);
  static_assert(kThreads == 32 * (kFusedProducerWarps + kFusedConsumerWarps),
                "a producer warpgroup and two consumer warpgroups");
};

constexpr int kConsumerThreads = 32 * kFusedConsumerWarps;  // the two consumer warpgroups
constexpr int kReduceRegisters = 160;

struct FusedStages {
  FusedMoeArgs a;
  int comm_units = 0;  // the first comm_units cluster units send (as the scheduler counts them)
  uint32_t reduce_need = 0;  // GEMM 2's done arrivals per tile
  // The reduce's next token, zeroed by fused_problems before each launch: warps take tokens in
  // turn as they leave the GEMM body (fused_reduce_tokens).
  uint32_t* reduce_ticket = nullptr;
};

template <class G>
__global__ void __launch_bounds__(G::Kernel::MaxThreadsPerBlock,
                                  G::Kernel::MinBlocksPerMultiprocessor)
    fused_moe_kernel(const __grid_constant__ typename G::Kernel::Params params,
                     const __grid_constant__ FusedStages st) {
  using Kernel = typename G::Kernel;
  constexpr int kThreads = G::kThreads;
  extern __shared__ char smem[];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const bool along_n = params.scheduler.raster_order_ == Kernel::TileScheduler::RasterOrder::AlongN;
  const uint64_t ctas = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
  const uint64_t units = Kernel::TileScheduler::units_in_grid(params.scheduler);
  const uint64_t per_unit = ctas / units;
  const uint64_t first = fused_first_linear(along_n);
  // Launched while the problem kernel still runs (fused_launch_impl): nothing it writes (the
  // problem arrays, the zeroed counters and scratch) is read before this.
  wait_for_prior_grid();
  unsigned long long* trace = st.a.trace != nullptr ? st.a.trace + 4 * cta_linear_index() : nullptr;
  if (trace != nullptr && threadIdx.x == 0) trace[0] = global_timer_ns();
  // 1. The send, by the first comm_units units (all of them when comm_units >= units).
  const uint64_t comm_units = static_cast<uint64_t>(st.comm_units);
  const uint64_t comm_ctas = (comm_units < units ? comm_units : units) * per_unit;
  if (first < comm_ctas) {
    const int64_t warps = static_cast<int64_t>(comm_ctas) * (kThreads / 32);
    const int64_t mine = static_cast<int64_t>(first) * (kThreads / 32) + warp;
    if (comm_ctas == ctas)
      fused_send_tokens(st.a, mine, warps, lane);
    else if (st.a.peers.world_size > 1)
      fused_send_order(st.a, mine, warps, lane);
    else
      fused_send_rows(st.a, mine, warps, lane);
  }
  __syncthreads();
  if (trace != nullptr && threadIdx.x == 0) trace[1] = global_timer_ns();
  // 2. Both GEMMs.
  Kernel{}(params, smem);
  // 3. The reduce, by the consumer warpgroups: the producer warpgroup has given its registers
  // to them (setmaxnreg) and may not run code that needs more.
  if (threadIdx.x >= 128) {
    // Down to a budget both paths out of the body share (232 after the consumers' setmaxnreg,
    // the launch's 168 where the CTA had no tile), so ptxas compiles the reduce for it instead
    // of the producer's 40.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kReduceRegisters));
    give_held_signal(params.epilogue.held, params.epilogue.num_held, params.epilogue.done2_system);
    if (trace != nullptr) {
      asm volatile("bar.sync 15, %0;" ::"n"(kConsumerThreads) : "memory");
      if (threadIdx.x == 128) trace[2] = global_timer_ns();
    }
    fused_reduce_tokens(st.a, st.reduce_ticket, lane, st.reduce_need);
    if (trace != nullptr) {
      asm volatile("bar.sync 15, %0;" ::"n"(kConsumerThreads) : "memory");
      if (threadIdx.x == 128) trace[3] = global_timer_ns();
    }
  }
}

template <class G>
typename G::Kernel::Arguments fused_arguments(const grouped::Workspace& ws, const FusedMoeArgs& a,
                                              int comm_units, int skip_rounds, int device,
                                              int sm_count, const FusedScratch& scratch = {}) {
  typename G::Kernel::Arguments args{};
  grouped::set_problem_arrays<grouped::KMajorA, grouped::NMajorB>(args, ws, 2 * a.num_experts);
  TileGate rows_gate =
      stored_rows_gate(a.counters, a.num_counters, a.tile_base, a.timeout_ns, a.timeout);
  rows_gate.waited_ns = a.gate_wait_ns;
  rows_gate.waited_stride = 2;
  TileGate done_gate = rows_gate;
  done_gate.waited_ns = a.gate_wait_ns != nullptr ? a.gate_wait_ns + 1 : nullptr;
  done_gate.counters = a.done1;
  done_gate.per_row = 0;
  done_gate.per_tile =
      static_cast<uint32_t>(G::kWarpsPerTile * ((2 * a.ffn + G::kTileN - 1) / G::kTileN));
  args.mainloop.gate = rows_gate;
  args.mainloop.gate2 = done_gate;
  args.mainloop.split = static_cast<int32_t>(a.num_experts);
  args.mainloop.stamps = a.tile_stamps;
  if constexpr (G::kW1AsStored) {
    // GEMM 1's groups [0, E) read w1 through the mainloop's own TMA; GEMM 2's their pointers.
    const grouped::PlainW1 w1{static_cast<const grouped::Bf16*>(a.w1_packed), a.hidden, 2 * a.ffn};
    G::Mainloop::set_w1(args.mainloop, w1, a.num_experts, a.num_experts);
  }
  args.epilogue.ptr_out = ws.ptr_d;
  args.epilogue.ld_act = a.ffn;
  args.epilogue.ld_y = a.hidden;
  args.epilogue.split = static_cast<int32_t>(a.num_experts);
  args.epilogue.done1 = a.done1;
  args.epilogue.done2 = a.done2;
  args.epilogue.tile_base = a.tile_base;
  args.epilogue.num_done = a.num_counters;
  args.epilogue.done2_system = a.peers.world_size > 1;
  args.epilogue.world = a.peers.world_size;
  args.epilogue.offs = a.offs;
  args.epilogue.row_src = a.peers.row_src[a.peers.rank];
  args.epilogue.capacity = a.capacity;
  args.epilogue.slots = a.peers.slots_per_rank;
  args.epilogue.combine_table = a.peers.combine_table;
  args.epilogue.parity_epoch = a.parity_epoch;
  args.epilogue.done2_parity_stride = a.done2_parity_stride;
  args.epilogue.held = scratch.held;
  args.epilogue.num_held = scratch.num_held;
  args.epilogue.stamps = a.tile_stamps;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  args.scheduler.raster_order = G::Kernel::TileScheduler::RasterOrderOptions::AlongM;
  args.scheduler.comm_units = comm_units;
  args.scheduler.skip_rounds = skip_rounds;
  return args;
}

// Bytes of the GEMM body's own workspace (per-SM tensor maps) for this tile shape.
template <class G>
size_t fused_gemm_workspace_impl(int64_t num_experts, int sm_count) {
  const grouped::Workspace ws =
      grouped::carve(reinterpret_cast<void*>(grouped::kWorkspaceAlign), 2 * num_experts);
  FusedMoeArgs a;
  a.num_experts = num_experts;
  a.ffn = 2;
  a.hidden = 2;
  return G::Kernel::get_workspace_size(fused_arguments<G>(ws, a, 0, 0, 0, sm_count));
}

// The launch over the problem arrays in `ws` (fused_problems filled them), the first comm_units
// cluster units sending, the others taking skip_rounds rounds first.
template <class G>
Status fused_launch_impl(const grouped::Workspace& ws, const FusedMoeArgs& a, int comm_units,
                         int skip_rounds, const FusedScratch& scratch, int device, int sm_count,
                         cudaStream_t stream) {
  using Kernel = typename G::Kernel;
  const auto args = fused_arguments<G>(ws, a, comm_units, skip_rounds, device, sm_count, scratch);
  typename Kernel::Params params;
  if (Status s = body_params<Kernel>(args, ws.gemm, stream, "the fused MoE kernel", &params);
      !s.ok())
    return s;
  FusedStages st;
  st.a = a;
  st.comm_units = comm_units;
  st.reduce_ticket = scratch.reduce_ticket;
  st.reduce_need =
      static_cast<uint32_t>(G::kWarpsPerTile * ((a.hidden + G::kTileN - 1) / G::kTileN));
  return launch_with_body<Kernel>(fused_moe_kernel<G>, params, stream, "moe_fused_forward_bf16",
                                  /*after_prior=*/true, st);
}

// The entry of one instantiation (launch.hpp), for its sm90_forward_<shape>.cu.
template <class G>
FusedEntry make_fused_entry() {
  FusedEntry e;
  e.tile_m = G::kTileM;
  e.tile_n = G::kTileN;
  e.cluster_m = G::kClusterM;
  e.w1_as_stored = G::kW1AsStored;
  e.gemm_workspace = &fused_gemm_workspace_impl<G>;
  e.launch = &fused_launch_impl<G>;
  return e;
}

}  // namespace uniep::cuda::megakernel
