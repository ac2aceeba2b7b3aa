// The bf16 instantiation of gemm.hpp: one CUTLASS 3 kernel, 128x256x64 tiles on clusters of two
// along M, cooperative (two consumer warpgroups per tile), persistent. The same kernel serves
// D = A @ B and D = A @ B + C: with beta = 0 the epilogue never loads C.
#include <cutlass/cutlass.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <limits>

#include "cuda/gemm/gemm.hpp"

namespace uniep::cuda {
namespace {

using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
constexpr int kAlign = 16 / sizeof(Bf16);  // TMA moves 16-byte aligned rows
using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, Bf16, RowMajor, kAlign, Bf16,
    RowMajor, kAlign, cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlign, Bf16, RowMajor,
    kAlign, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop,
                                                    Epilogue, cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

// Row-major A is K-major, row-major B (k x n) is N-major, row-major C/D are N-major: the stride
// types the builder chose for those layouts.
static_assert(cute::is_same_v<typename Kernel::StrideA, cute::Stride<int64_t, cute::_1, int64_t>>);
static_assert(cute::is_same_v<typename Kernel::StrideB, cute::Stride<cute::_1, int64_t, int64_t>>);
static_assert(cute::is_same_v<typename Kernel::StrideC, cute::Stride<int64_t, cute::_1, int64_t>>);
static_assert(cute::is_same_v<typename Kernel::StrideD, cute::Stride<int64_t, cute::_1, int64_t>>);

typename Gemm::Arguments arguments(const GemmOperands& op, int device, int sm_count) {
  using StrideRow = cute::Stride<int64_t, cute::_1, int64_t>;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
  args.problem_shape = {static_cast<int>(op.m), static_cast<int>(op.n), static_cast<int>(op.k), 1};
  args.mainloop.ptr_A = static_cast<const Bf16*>(op.a);
  args.mainloop.dA = StrideRow{op.lda, cute::_1{}, op.m * op.lda};
  args.mainloop.ptr_B = static_cast<const Bf16*>(op.b);
  args.mainloop.dB = typename Kernel::StrideB{cute::_1{}, op.ldb, op.k * op.ldb};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = op.c != nullptr ? 1.0f : 0.0f;
  // Without an addend C is never read (beta = 0), but its TMA descriptor is still built: D's
  // address and layout are a valid placeholder.
  args.epilogue.ptr_C = static_cast<const Bf16*>(op.c != nullptr ? op.c : op.d);
  args.epilogue.dC = StrideRow{op.c != nullptr ? op.ldc : op.ldd, cute::_1{},
                               op.m * (op.c != nullptr ? op.ldc : op.ldd)};
  args.epilogue.ptr_D = static_cast<Bf16*>(op.d);
  args.epilogue.dD = StrideRow{op.ldd, cute::_1{}, op.m * op.ldd};
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

bool gemm_sm90_device_ok(int device) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

Status gemm_sm90_supports(const GemmOperands& op) {
  auto no = [](const char* what) {
    return Status{StatusCode::kUnsupported, detail::str_cat("the sm90 GEMM needs ", what)};
  };
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (op.m < 1 || op.n < 1 || op.k < 1 || op.m > kMax || op.n > kMax || op.k > kMax)
    return no("extents m, n, k in [1, 2^31)");
  if (op.n % kAlign != 0 || op.k % kAlign != 0) return no("n and k multiples of 8");
  if (op.lda < op.k || op.ldb < op.n || op.ldd < op.n || (op.c && op.ldc < op.n))
    return no("leading dimensions at least the row length");
  if (op.lda % kAlign || op.ldb % kAlign || op.ldd % kAlign || (op.c && op.ldc % kAlign))
    return no("leading dimensions that are multiples of 8 elements");
  if (!aligned(op.a) || !aligned(op.b) || !aligned(op.d) || (op.c && !aligned(op.c)))
    return no("16-byte aligned operands");
  if (op.c == op.d) return no("an addend that is not the output");
  return Status::Ok();
}

size_t gemm_sm90_workspace_bytes(const GemmOperands& op, int sm_count) {
  return Gemm::get_workspace_size(arguments(op, 0, sm_count));
}

Status gemm_sm90_bf16(const GemmOperands& op, int device, int sm_count, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  if (Status s = gemm_sm90_supports(op); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  const typename Gemm::Arguments args = arguments(op, device, sm_count);
  if (Gemm::get_workspace_size(args) > workspace_bytes)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("the sm90 GEMM needs ", Gemm::get_workspace_size(args),
                            " bytes of workspace, got ", workspace_bytes)};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return {StatusCode::kUnsupported, "the sm90 GEMM cannot implement these operands"};
  cutlass::Status s = gemm.initialize(args, workspace, stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the sm90 GEMM failed to launch: ", cutlassGetStatusString(s), " (",
                            cudaGetErrorString(cudaGetLastError()), ")")};
  return Status::Ok();
}

}  // namespace uniep::cuda
