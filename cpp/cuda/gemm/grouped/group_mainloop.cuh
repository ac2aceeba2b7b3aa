// What the mainloop wrappers around CUTLASS's ptr-array mainloop share: the engine's
// PlainGateUpMainloop (gate_up_mainloop.cuh) and the MegaKernel's GatedMainloop
// (megakernel/gated_mainloop.cuh). Each adds fields of its own to the base's Params and needs the
// group (the expert) of the tiles the producer warp loads.
//
// Why the group is tracked here: the kernels hand load() a batch coordinate of 0 (their groups
// have their own descriptors), so a wrapper learns the group from tensormaps_perform_update,
// which the producer warp calls for its first group and at every change of group, before the
// group's first load. A, B, the pipeline, the consumers and the tile scheduler stay the base's.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include <cstdint>

namespace uniep::cuda::grouped {

template <class Base>
struct GroupTrackingMainloop : Base {
  // Remembers which group the next tiles belong to and its rows, then the base's update.
  template <class TensorMapA, class TensorMapB, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(
      typename Base::TensorMapStorage& shared_tensormaps, const typename Base::Params& params,
      const cute::tuple<TensorMapA, TensorMapB>& input_tensormaps, ProblemShapeMNKL problem_mnkl,
      int32_t next_batch) {
    group_ = next_batch;
    group_rows_ = static_cast<int>(cute::get<0>(problem_mnkl));
    Base::tensormaps_perform_update(shared_tensormaps, params, input_tensormaps, problem_mnkl,
                                    next_batch);
  }

 protected:
  // A wrapper's Params P (derived from the base's) with the base's part made from args; the
  // wrapper then sets its own fields.
  template <class P, class ProblemShape, class Arguments>
  static P base_params(ProblemShape problem_shapes, const Arguments& args, void* workspace) {
    P p;
    static_cast<typename Base::Params&>(p) =
        Base::to_underlying_arguments(problem_shapes, args, workspace);
    return p;
  }

  int32_t group_ = 0;   // the group of the tiles load() is handed next
  int group_rows_ = 0;  // its M
};

}  // namespace uniep::cuda::grouped
