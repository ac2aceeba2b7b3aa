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
    per_unit_ = uint64_t(gridDim.x) * gridDim.y * gridDim.z / units_in_grid(params);
    units_ = units_in_grid(params);
    offset_ = first % per_unit_;
    unit_ = first / per_unit_;
    comm_ = params.comm_units < 0 ? 0 : uint64_t(params.comm_units);
    if (comm_ >= units_) comm_ = 0;  // nobody left to take the first rounds: plain order
    skip_ = comm_ == 0 || params.skip_rounds < 0 ? 0 : uint64_t(params.skip_rounds);
    step_ = 0;
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
    return Base::get_current_work_for_linear_idx(linear());
  }

  template <typename Pipeline, typename PipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(Pipeline& pipeline, PipelineState state,
                                           uint32_t advance_count = 1) {
    step_ += advance_count;
    const WorkTileInfo work = Base::get_current_work_for_linear_idx(linear());
    pipeline.producer_acquire(state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[state.index()] = work;
      cutlass::arch::fence_view_async_shared();
      pipeline.producer_commit(state);
    }
    return cute::make_tuple(work, true);
  }

 private:
  // The unit-level index of this unit's step-th tile, as a CTA-level linear index.
  CUTLASS_DEVICE uint64_t linear() const {
    const uint64_t others = units_ - comm_;
    const uint64_t early = skip_ * others;
    uint64_t u;
    if (unit_ >= comm_ && step_ < skip_)
      u = (unit_ - comm_) + step_ * others;
    else
      u = early + unit_ + (unit_ >= comm_ ? step_ - skip_ : step_) * units_;
    return u * per_unit_ + offset_;
  }

  uint64_t per_unit_ = 1, units_ = 1, offset_ = 0, unit_ = 0, comm_ = 0, skip_ = 0, step_ = 0;
};

}  // namespace uniep::cuda::megakernel

namespace cutlass::gemm::kernel::detail {

template <class TileShape, class ClusterShape, uint32_t Stages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, Stages,
                             uniep::cuda::megakernel::FusedProblemShape> {
  using Scheduler = uniep::cuda::megakernel::SkewedGroupScheduler<static_cast<int>(Stages)>;
};

}  // namespace cutlass::gemm::kernel::detail
