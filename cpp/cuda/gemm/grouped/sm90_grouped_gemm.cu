// include/uniep/cuda/grouped_gemm.hpp's entry points: argument checks, the workspace, the problem
// kernel (grouped_problems.cuh) and the CUTLASS grouped kernel (sm90_grouped_gemm_kernel.cuh).
// The one CUTLASS translation unit of the expert GEMM engine.
#include <cuda_runtime.h>

#include <limits>

#include "cuda/gemm/gemm.hpp"
#include "cuda/gemm/grouped/grouped_problems.cuh"
#include "cuda/gemm/grouped/sm90_grouped_gemm_kernel.cuh"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda {
namespace {

using G = Sm90Bf16GroupedGemm;

constexpr int64_t kAlign = G::kAlign;
constexpr int64_t kMaxExtent = std::numeric_limits<int>::max();

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The kernel's arguments; the shapes, pointers and strides are the workspace arrays that the
// problem kernel fills (no host copy of the shapes: host_problem_shapes stays null, and the
// persistent grid is then simply sm_count CTAs).
G::Gemm::Arguments arguments(const grouped::Workspace& ws, int64_t num_experts, int device,
                             int sm_count) {
  G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(num_experts), ws.shapes, nullptr};
  args.mainloop.ptr_A = ws.ptr_a;
  args.mainloop.dA = ws.stride_a;
  args.mainloop.ptr_B = ws.ptr_b;
  args.mainloop.dB = ws.stride_b;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = ws.ptr_d;
  args.epilogue.dD = ws.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

size_t gemm_workspace_bytes(int64_t num_experts, int sm_count) {
  // Depends on the SM count only (per-SM TMA descriptors); any aligned base gives the sizes.
  const grouped::Workspace ws =
      grouped::carve(reinterpret_cast<void*>(grouped::kWorkspaceAlign), num_experts);
  return G::Gemm::get_workspace_size(arguments(ws, num_experts, 0, sm_count));
}

}  // namespace

bool grouped_gemm_device_ok(int device) {
  return gemm_sm90_device_ok(device);  // the same sm_90a-only build as the dense GEMM
}

Status grouped_gemm_supports(const GroupedGemmProblem& p) {
  auto bad = [](auto&&... what) {
    return Status{StatusCode::kInvalidArgument, detail::str_cat(what...)};
  };
  auto unsupported = [](auto&&... what) {
    return Status{StatusCode::kUnsupported, detail::str_cat(what...)};
  };
  if (p.num_experts < 1 || p.num_experts > kMaxExtent)
    return bad("num_experts must be in [1, 2^31), got ", p.num_experts);
  if (p.rows < 0 || p.rows > kMaxExtent) return bad("rows must be in [0, 2^31), got ", p.rows);
  if (p.k < 1 || p.k > kMaxExtent) return bad("k must be in [1, 2^31), got ", p.k);
  if (p.n < 1 || p.n > kMaxExtent) return bad("n must be in [1, 2^31), got ", p.n);
  if (p.k % kAlign != 0)
    return unsupported("k must be a multiple of ", kAlign,
                       " (the grouped GEMM's TMA moves 16-byte rows), got ", p.k);
  if (p.n % kAlign != 0)
    return unsupported("n must be a multiple of ", kAlign,
                       " (the grouped GEMM's TMA moves 16-byte rows), got ", p.n);
  if (p.offs == nullptr) return bad("offs must not be null");
  if (p.w == nullptr || !aligned(p.w)) return unsupported("w must be 16-byte aligned (non-null)");
  if (p.rows > 0 && (p.x == nullptr || !aligned(p.x)))
    return unsupported("x must be 16-byte aligned (non-null)");
  if (p.rows > 0 && (p.out == nullptr || !aligned(p.out)))
    return unsupported("out must be 16-byte aligned (non-null)");
  return Status::Ok();
}

size_t grouped_gemm_workspace_bytes(int64_t num_experts, int sm_count) {
  if (num_experts < 1 || num_experts > kMaxExtent || sm_count < 1) return 0;
  return grouped::group_arrays_bytes(num_experts) + gemm_workspace_bytes(num_experts, sm_count);
}

Status grouped_gemm_bf16(const GroupedGemmProblem& p, int device, int sm_count, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  if (Status s = grouped_gemm_supports(p); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  if (p.rows == 0) return Status::Ok();
  const size_t need = grouped_gemm_workspace_bytes(p.num_experts, sm_count);
  if (workspace == nullptr || workspace_bytes < need)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("the grouped GEMM needs ", need, " bytes of workspace, got ",
                            workspace_bytes)};
  if (reinterpret_cast<uintptr_t>(workspace) % grouped::kWorkspaceAlign != 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("workspace must be ", grouped::kWorkspaceAlign, "-byte aligned")};

  const grouped::Workspace ws = grouped::carve(workspace, p.num_experts);
  grouped::build_grouped_problems<<<1, 32, 0, stream>>>(
      p.offs, static_cast<int>(p.num_experts), static_cast<int>(p.rows), static_cast<int>(p.k),
      static_cast<int>(p.n), static_cast<const G::Bf16*>(p.x), static_cast<const G::Bf16*>(p.w),
      static_cast<G::Bf16*>(p.out), ws);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the grouped GEMM's problem kernel failed to launch: ",
                            cudaGetErrorString(e))};

  const G::Gemm::Arguments args = arguments(ws, p.num_experts, device, sm_count);
  G::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return {StatusCode::kUnsupported, "the grouped GEMM cannot implement these operands"};
  cutlass::Status s = gemm.initialize(args, ws.gemm, stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the grouped GEMM failed to launch: ", cutlassGetStatusString(s), " (",
                            cudaGetErrorString(cudaGetLastError()), ")")};
  return Status::Ok();
}

}  // namespace uniep::cuda
