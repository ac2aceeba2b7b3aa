// Where the grouped GEMM keeps its per-expert arrays inside the caller's workspace: E entries of
// each array, then CUTLASS's own workspace (its per-SM TMA descriptors).
#pragma once

#include <cutlass/gemm/gemm_enumerated_types.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/gemm/grouped/grouped_types.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda::grouped {

// Every piece starts on a 256-byte boundary (CUTLASS wants 64 for descriptors;
// 256 keeps each array in whole cache lines).
struct Workspace {
  Shape* shapes = nullptr;
  const Bf16** ptr_a = nullptr;
  const Bf16** ptr_b = nullptr;
  Bf16** ptr_d = nullptr;
  int64_t* stride_a = nullptr;  // 8-byte slots: the kind's A stride type (grouped_types.hpp)
  int64_t* stride_b = nullptr;  // 8-byte slots: the kind's B stride type
  StrideD* stride_d = nullptr;
  void* gemm = nullptr;
};

constexpr size_t kWorkspaceAlign = 256;

inline size_t round_up(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// Bytes before the CUTLASS workspace for E groups.
inline size_t group_arrays_bytes(int64_t num_experts) {
  const size_t e = static_cast<size_t>(num_experts);
  return round_up(e * sizeof(Shape)) + 3 * round_up(e * sizeof(void*)) +
         2 * round_up(e * sizeof(int64_t)) + round_up(e * sizeof(StrideD));
}

// The pieces of a workspace at `base` (256-byte aligned) for E groups.
inline Workspace carve(void* base, int64_t num_experts) {
  const size_t e = static_cast<size_t>(num_experts);
  char* p = static_cast<char*>(base);
  auto take = [&p](size_t bytes) {
    char* at = p;
    p += round_up(bytes);
    return at;
  };
  Workspace ws;
  ws.shapes = reinterpret_cast<Shape*>(take(e * sizeof(Shape)));
  ws.ptr_a = reinterpret_cast<const Bf16**>(take(e * sizeof(void*)));
  ws.ptr_b = reinterpret_cast<const Bf16**>(take(e * sizeof(void*)));
  ws.ptr_d = reinterpret_cast<Bf16**>(take(e * sizeof(void*)));
  ws.stride_a = reinterpret_cast<int64_t*>(take(e * sizeof(int64_t)));
  ws.stride_b = reinterpret_cast<int64_t*>(take(e * sizeof(int64_t)));
  ws.stride_d = reinterpret_cast<StrideD*>(take(e * sizeof(StrideD)));
  ws.gemm = p;
  return ws;
}

// A caller's workspace for a kernel that needs `need` bytes: kInvalidArgument naming `what` (the
// kernel) when it is missing, too small or not 256-byte aligned.
inline Status check_workspace(const void* workspace, size_t workspace_bytes, size_t need,
                              const char* what) {
  if (workspace == nullptr || workspace_bytes < need)
    return {StatusCode::kInvalidArgument,
            detail::str_cat(what, " needs ", need, " bytes of workspace, got ", workspace_bytes)};
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlign != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("workspace must be ", kWorkspaceAlign, "-byte aligned")};
  return Status::Ok();
}

// The arguments every grouped kernel over a workspace's problem arrays shares (the engine's, the
// gated GEMM's, the MegaKernel's): num_groups groups whose shapes, pointers and strides the
// problem kernel wrote, each A and B stride's one dynamic value in its 8-byte slot. No host copy
// of the shapes: host_problem_shapes stays null, and the persistent grid is then simply sm_count
// CTAs.
template <class StrideA, class StrideB, class Arguments>
void set_problem_arrays(Arguments& args, const Workspace& ws, int64_t num_groups) {
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape.num_groups = static_cast<int>(num_groups);
  args.problem_shape.problem_shapes = ws.shapes;
  args.problem_shape.host_problem_shapes = nullptr;
  args.mainloop.ptr_A = ws.ptr_a;
  args.mainloop.dA = reinterpret_cast<StrideA*>(ws.stride_a);
  args.mainloop.ptr_B = ws.ptr_b;
  args.mainloop.dB = reinterpret_cast<StrideB*>(ws.stride_b);
}

// The arguments every grouped kernel with the TMA store epilogue shares: D = acc into the
// workspace's per-group out pointers and strides (no C), on sm_count SMs of device.
template <class Arguments>
void set_store_epilogue(Arguments& args, const Workspace& ws, int device, int sm_count) {
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  // The slots hold bf16 pointers; the fp32 store epilogue's point at fp32 rows.
  args.epilogue.ptr_D =
      reinterpret_cast<std::remove_reference_t<decltype(args.epilogue.ptr_D)>>(ws.ptr_d);
  // The slot holds one 8-byte stride whichever its layout (out^T's, column-major, for the fp8
  // tiles with the operands swapped).
  using Slot = std::remove_pointer_t<decltype(args.epilogue.dD)>;
  static_assert(sizeof(Slot) == sizeof(StrideD));
  args.epilogue.dD = reinterpret_cast<Slot*>(ws.stride_d);
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
}

}  // namespace uniep::cuda::grouped
