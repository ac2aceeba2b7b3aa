// The fused MoE kernel's tile scheduler: CUTLASS's grouped (ptr-array) persistent scheduler with
// the first output tiles kept away from the communication CTAs (docs/megakernel.md).
//
// Why: the persistent scheduler hands cluster unit u the linear tiles u, u + G, u + 2G, ... (G
// units in the grid). In the fused kernel the first `comm_units` units store the dispatch's rows
// before they compute, so with that order their first tiles would start one send later than
// everybody else's, and the whole GEMM would end that much later. Here the other units alone
// take the first `skip_rounds` rounds (linear tiles [0, skip_rounds * (G - comm_units))), and
// then every unit continues round-robin. Each unit's tiles still come in increasing order, which
// the group walk needs and which keeps the MegaKernel's waits acyclic: every GEMM-1 tile precedes
// every GEMM-2 tile in linear order. Which CTA computes a tile never changes its bits.
//
// Reached through CUTLASS's scheduler selector: the ptr-array kernels accept only their default
// scheduler tag, so the selector is specialized for FusedProblemShape, a distinct type with
// GroupProblemShape's layout that only the fused kernel uses.
#pragma once

#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "cuda/gemm/grouped/grouped_types.hpp"

namespace uniep::cuda::megakernel {

struct FusedProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {};

// Which cluster unit a CTA belongs to: CUTLASS's first linear tile index of the CTA (its raster
// order's formula) divided by the CTAs per cluster. Host and device agree on it through here.
__device__ __forceinline__ uint64_t fused_first_linear(bool along_n) {
  return along_n ? uint64_t(blockIdx.x) + uint64_t(blockIdx.y) * uint64_t(gridDim.x)
                 : uint64_t(blockIdx.x) * uint64_t(gridDim.y) + uint64_t(blockIdx.y);
}

template <int Stages>
class SkewedGroupScheduler
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<FusedProblemShape,
                                                                               Stages> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<FusedProblemShape, Stages>;

 public:
  using typename Base::SchedulerResponse;
  using typename Base::WorkTileInfo;

  struct Arguments : Base::Arguments {
    int comm_units = 0;   // cluster units that send before they compute
    int skip_rounds = 0;  // rounds of tiles the others take first
  };
  struct Params : Base::Params {
    int comm_units = 0;
    int skip_rounds = 0;
  };

  template <class TileShape, class ClusterShape>
  static Params to_underlying_arguments(FusedProblemShape problem_shapes, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(
        problem_shapes, tile_shape, cluster_shape, hw_info, args, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    p.comm_units = args.comm_units;
    p.skip_rounds = args.skip_rounds;
    return p;
  }

  SkewedGroupScheduler() = default;

  CUTLASS_DEVICE SkewedGroupScheduler(Params const& params, SchedulerResponse* response)
      : Base(params, response) {
    const bool along_n = params.raster_order_ == Base::RasterOrder::AlongN;
    const uint64_t first = fused_first_linear(along_n);
    const uint64_t units = units_in_grid(params);
    const uint64_t per_unit = uint64_t(gridDim.x) * gridDim.y * gridDim.z / units;
    const uint64_t offset = first % per_unit, unit = first / per_unit;
    uint64_t comm = params.comm_units < 0 ? 0 : uint64_t(params.comm_units);
    if (comm >= units) comm = 0;  // nobody left to take the first rounds: plain order
    const uint64_t skip = comm == 0 || params.skip_rounds < 0 ? 0 : uint64_t(params.skip_rounds);
    // The walk as two arithmetic runs (few registers: the scheduler warp lives on the producer
    // warpgroup's 40): the others' first `skip` tiles with the others' stride, then everyone's
    // round-robin from skip x others on with the whole grid's stride.
    const uint64_t others = units - comm, early = skip * others;
    after_ = ((early + unit) * per_unit + offset);
    stride_ = units * per_unit;
    if (unit >= comm && skip > 0) {
      cur_ = (unit - comm) * per_unit + offset;
      early_stride_ = others * per_unit;
      early_left_ = static_cast<uint32_t>(skip - 1);
    } else {
      cur_ = after_;
      early_left_ = kNoEarly;
    }
  }

  // The cluster units of the grid (every CTA of a unit walks the same tiles).
  CUTLASS_DEVICE static uint64_t units_in_grid(Params const& params) {
    const uint64_t ctas = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
    const uint64_t per = params.divmod_cluster_shape_major_.divisor *
                         params.divmod_cluster_shape_minor_.divisor;
    return per > 0 ? ctas / per : ctas;
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return Base::get_current_work_for_linear_idx(cur_);
  }

  template <typename Pipeline, typename PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           uint32_t advance_count = 1) {
    for (uint32_t i = 0; i < advance_count; ++i) {
      if (early_left_ == kNoEarly) {
        cur_ += stride_;
      } else if (early_left_ == 0) {
        cur_ = after_;
        early_left_ = kNoEarly;
      } else {
        cur_ += early_stride_;
        --early_left_;
      }
    }
    const WorkTileInfo work = Base::get_current_work_for_linear_idx(cur_);
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  static constexpr uint32_t kNoEarly = 0xffffffffu;
  uint64_t cur_ = 0, after_ = 0, stride_ = 1, early_stride_ = 0;
  uint32_t early_left_ = kNoEarly;  // early tiles still to come after the current one
};

}  // namespace uniep::cuda::megakernel

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages,
                             uniep::cuda::megakernel::FusedProblemShape> {
  using Scheduler = uniep::cuda::megakernel::SkewedGroupScheduler<static_cast<int>(Stages)>;
};

}  // namespace cutlass::gemm::kernel::detail
