// What the epilogues that store straight from the fp32 accumulators share (SwiGluEpilogue, the
// fused MoE kernel's FusedMoeEpilogue): the names and the static interface CUTLASS's
// operator-style ptr-array epilogues have (DefaultEpilogueArray), through which they run inside
// the warp-specialized kernels
// (cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter), the call that adapter
// makes once per output tile (DirectTileCall), and the SwiGLU arithmetic they apply alike.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>

#include "cuda/common/swiglu_math.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/megakernel/tile_gate.cuh"

namespace uniep::cuda::grouped {

// The arguments of the direct epilogues that store one output per group and may signal it:
// where each group's rows go, and the done counters of SwiGluEpilogue / SignalStoreEpilogue
// (signal_tile_done).
struct DirectOutArguments {
  Bf16** ptr_out = nullptr;  // per group: row 0 of its rows of out
  int64_t ld_out = 0;        // elements between rows of out (even)
  // Once a warp has written its part of output tile (group g, m-tile i), it adds 1 to
  // done[done_base[g] + i], so the tile's rows are complete at (consumer warps per tile) x
  // (N-tiles) arrivals. Null: no signal.
  uint32_t* done = nullptr;
  const int32_t* done_base = nullptr;
  int64_t num_done = 0;  // entries of done; a tile outside them is not signalled
};

struct DirectStoreEpilogue {
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementC = void;  // no source operand
  using ElementD = Bf16;
  using ElementOutput = Bf16;
  using InternalStrideC = ::uniep::cuda::grouped::StrideD;
  using StrideC = InternalStrideC*;
  using InternalStrideD = ::uniep::cuda::grouped::StrideD;
  using StrideD = InternalStrideD*;
  // Named by the device adapter (GemmUniversalAdapter); never applied.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<Bf16, 1, float, float>;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  // No shared memory: the mainloop keeps all of it for its stages.
  struct SharedStorage {};
  using TensorMapStorage = SharedStorage;

  // Params are the Arguments as given.
  template <class ProblemShape, class Arguments>
  static constexpr Arguments to_underlying_arguments(const ProblemShape&, const Arguments& args,
                                                     void*) {
    return args;
  }
  template <class ProblemShape, class Arguments>
  static size_t get_workspace_size(const ProblemShape&, const Arguments&, int) {
    return 0;
  }
  template <class ProblemShape, class Arguments>
  static cutlass::Status initialize_workspace(const ProblemShape&, const Arguments&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  // For the epilogues whose Arguments are DirectOutArguments (others define their own).
  template <class ProblemShape>
  static bool can_implement(const ProblemShape&, const DirectOutArguments& args) {
    return args.ptr_out != nullptr && args.ld_out > 0 && args.ld_out % 2 == 0;
  }

  // The (m, n) place within its group's output of each value of this thread's accumulator
  // fragment, a WGMMA fragment: ((2 columns, 2 row halves, N/8 column blocks), M, N).
  template <class FrgLayout, class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL,
            class TiledMma>
  CUTLASS_DEVICE static auto fragment_coords(ProblemShapeMNKL problem_shape_mnkl,
                                             BlockShapeMNK blk_shape_mnk,
                                             BlockCoordMNKL blk_coord_mnkl, TiledMma tiled_mma,
                                             int thread_idx) {
    using namespace cute;
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2,
                  "the direct epilogues expect a WGMMA accumulator fragment");
    Tensor coords = make_identity_tensor(make_shape(static_cast<int>(get<0>(problem_shape_mnkl)),
                                                    static_cast<int>(get<1>(problem_shape_mnkl))));
    Tensor tile = local_tile(coords, take<0, 2>(blk_shape_mnk),
                             make_coord(get<0>(blk_coord_mnkl), get<1>(blk_coord_mnkl)));
    return tiled_mma.get_thread_slice(thread_idx).partition_C(tile);
  }

  // Once this warp has stored its part of output tile m_tile of `expert` (M rows, tile_m rows a
  // tile): one lane adds 1 to done[tile_base[expert] + m_tile]. The warp barrier orders every
  // lane's stores before that lane's release (at GPU scope, or at system scope with `system`
  // where the waiter may be on a peer GPU). A tile
  // past the expert's rows (the scheduler pads each expert to the cluster's M) stored nothing and
  // has no counter of its own; a counter outside the num_done is not signalled (its waiter then
  // times out naming it). done null: no signal.
  CUTLASS_DEVICE static void signal_tile_done(uint32_t* done, const int32_t* tile_base, int expert,
                                              int m_tile, int tile_m, int M, int64_t num_done,
                                              bool system = false) {
    if (done == nullptr || m_tile * tile_m >= M) return;
    __syncwarp();
    uint32_t* counter = tile_done_counter(done, tile_base, expert, m_tile, tile_m, M, num_done);
    // A waiter on another GPU (the fused kernel's reduce with peers) needs the release at
    // system scope; one lane's, like the GPU-scope one.
    if (threadIdx.x % 32 == 0 && counter != nullptr)
      megakernel::gate_signal_at(counter, 1u, system);
  }

  // The counter signal_tile_done adds to, or null where it signals nothing.
  CUTLASS_DEVICE static uint32_t* tile_done_counter(uint32_t* done, const int32_t* tile_base,
                                                    int expert, int m_tile, int tile_m, int M,
                                                    int64_t num_done) {
    if (done == nullptr || m_tile * tile_m >= M) return nullptr;
    const int64_t index = static_cast<int64_t>(tile_base[expert]) + m_tile;
    return index >= 0 && index < num_done ? done + index : nullptr;
  }

  // The chain's numerics and the CPU executor's: gate and up rounded to bf16 (where the chain
  // stored h), silu(g) * u in fp32 (silu_mul: swiglu_math.cuh says why its exp and reciprocal
  // are the approximate ones).
  CUTLASS_DEVICE static float swiglu(float gate, float up) {
    return silu_mul(static_cast<float>(Bf16(gate)), static_cast<float>(Bf16(up)));
  }

  CUTLASS_DEVICE static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&b);
  }

  // The SwiGLU of the (gate, up) column pairs among this thread's fragment values [i, i + kAtom)
  // (one WGMMA atom across the tile's N), into out [M, ld] at the activation's columns: two
  // adjacent activation columns a 4-byte store, no shared memory, no shuffle. kPair is the width
  // of the gate and up column blocks as the tile holds them, alternating: 8 for pack_gate_up's
  // layout, 64 for w1 as stored, read through PlainGateUpMainloop. A fragment holds two
  // adjacent columns of every 8-column block, 4 values a block, so the up value of a gate value
  // sits kPair / 2 values on. With 16-byte stores instead the fused kernel's GEMM 1 read 1.5x
  // the DRAM bytes and ran slower (epilogue.cuh).
  template <int kPair, int kAtom, class Acc, class Crd>
  CUTLASS_DEVICE static void store_swiglu(const Acc& acc, const Crd& crd, int i, int M, int N,
                                          __nv_bfloat16* out, int64_t ld) {
    static_assert(kPair == 8 || kPair == 64, "gate/up blocks of 8 or 64 columns");
    static_assert(kAtom % kPair == 0, "an atom must hold whole (gate, up) block pairs");
    constexpr int kUp = kPair / 2;
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {  // the fragment's two row halves
      CUTLASS_PRAGMA_UNROLL
      for (int v = 2 * h; v < kAtom; v += 4) {
        if ((v / 4) / (kPair / 8) % 2 != 0) continue;  // an up block
        const auto c = crd(i + v);
        const int m = cute::get<0>(c), n = cute::get<1>(c);
        if (m >= M || n >= N) continue;
        const uint32_t w = pack(swiglu(acc(i + v), acc(i + v + kUp)),
                                swiglu(acc(i + v + 1), acc(i + v + 1 + kUp)));
        const int64_t j = (n / (2 * kPair)) * kPair + n % kPair;
        *reinterpret_cast<uint32_t*>(out + m * ld + j) = w;
      }
    }
  }
};

// One output tile as a direct epilogue sees it: its group's M and N, its m-tile (of tile_m rows)
// and group, and the (m, n) of each value of this thread's fragment
// (DirectStoreEpilogue::fragment_coords).
template <class Crd>
struct DirectTile {
  int M, N, m_tile, tile_m, group;
  Crd crd;
};

// The call Sm90TmaWarpSpecializedAdapter::store makes once per output tile, for a direct
// epilogue Op (a DirectStoreEpilogue deriving from DirectTileCall<Op> too) that stores the tile
// in Op::store_tile<kAtom>(tile, acc), kAtom the values of one WGMMA atom across the tile's N.
template <class Op>
struct DirectTileCall {
  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 const cute::Tensor<FrgEngine, FrgLayout>& acc, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    constexpr int kAtom = size<0>(FrgLayout{});
    auto crd = DirectStoreEpilogue::fragment_coords<FrgLayout>(
        problem_shape_mnkl, blk_shape_mnk, blk_coord_mnkl, tiled_mma, thread_idx);
    const DirectTile<decltype(crd)> tile{
        static_cast<int>(get<0>(problem_shape_mnkl)), static_cast<int>(get<1>(problem_shape_mnkl)),
        static_cast<int>(get<0>(blk_coord_mnkl)),     static_cast<int>(size<0>(blk_shape_mnk)),
        static_cast<int>(get<3>(blk_coord_mnkl)),     crd};
    static_cast<Op*>(this)->template store_tile<kAtom>(tile, acc);
  }
};

}  // namespace uniep::cuda::grouped
