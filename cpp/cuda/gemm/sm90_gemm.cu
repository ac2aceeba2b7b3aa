// gemm.hpp's entry points: operand checks, the choice of tile, and the dispatch to the
// instantiations (sm90_bf16_gemm_n128.cu, sm90_bf16_gemm_n256.cu). No CUTLASS here, so this
// file compiles in seconds.
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>

#include "cuda/gemm/gemm.hpp"
#include "cuda/gemm/sm90_gemm_configs.hpp"

namespace uniep::cuda {
namespace {

constexpr int kAlign = 8;  // bf16 elements in the 16 bytes TMA needs

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

int tile_n_for(const GemmOperands& op, const GemmTuning& tuning, int sm_count) {
  return tuning.tile_n != 0 ? tuning.tile_n : gemm_sm90_auto_tile_n(op, sm_count);
}

}  // namespace

Status GemmTuning::validate() const {
  if (tile_n != 0 && tile_n != 128 && tile_n != 256)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("tile_n must be 0 (auto), 128 or 256, got ", tile_n)};
  if (swizzle != 0 && swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("swizzle must be 0 (auto), 1, 2, 4 or 8, got ", swizzle)};
  return Status::Ok();
}

int auto_tile_n_for_cluster_rows(int64_t cluster_rows, int64_t n, int sm_count) {
  // Clusters of two tiles along M: a wave is sm_count / 2 clusters.
  const int64_t clusters = std::max<int64_t>(1, sm_count / 2);
  const double waves_256 = static_cast<double>(ceil_div(cluster_rows * ceil_div(n, 256), clusters));
  const double waves_128 = static_cast<double>(ceil_div(cluster_rows * ceil_div(n, 128), clusters));
  return waves_128 * 0.5 / 0.9 < waves_256 ? 128 : 256;
}

int gemm_sm90_auto_tile_n(const GemmOperands& op, int sm_count) {
  return auto_tile_n_for_cluster_rows(ceil_div(ceil_div(op.m, 128), 2), op.n, sm_count);
}

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

size_t gemm_sm90_workspace_bytes(const GemmOperands& op, const GemmTuning& tuning, int sm_count) {
  // Operands the kernel refuses (gemm_sm90_bf16 says why) get none, whatever their extents.
  if (!gemm_sm90_supports(op).ok() || !tuning.validate().ok() || sm_count < 1) return 0;
  return tile_n_for(op, tuning, sm_count) == 128 ? sm90_gemm_workspace_n128(op, tuning, sm_count)
                                                 : sm90_gemm_workspace_n256(op, tuning, sm_count);
}

Status gemm_sm90_bf16(const GemmOperands& op, const GemmTuning& tuning, int device, int sm_count,
                      void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (Status s = gemm_sm90_supports(op); !s.ok()) return s;
  if (Status s = tuning.validate(); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  if (tile_n_for(op, tuning, sm_count) == 128)
    return sm90_gemm_run_n128(op, tuning, device, sm_count, workspace, workspace_bytes, stream);
  return sm90_gemm_run_n256(op, tuning, device, sm_count, workspace, workspace_bytes, stream);
}

}  // namespace uniep::cuda
