// CUDA implementation of uniep::grouped_mm (schema in registration.cpp): torch._grouped_mm's
// bf16 (x [R, K], w [E, K, N], offs [E]) -> [R, N] on UniEP's grouped GEMM
// (include/uniep/cuda/grouped_gemm.hpp). No host sync: offs stays on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "torch/grouped_gemm.hpp"
#include "torch/runtime_registry.hpp"
#include "torch/validate.hpp"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::torch_glue {
namespace {

constexpr int64_t kAlign = 8;  // bf16 elements in the 16 bytes a TMA row needs

void check_grouped_mm_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  UNIEP_CHECK(x.dim() == 2, "x must be 2-D [R, K], got shape ", x.sizes());
  UNIEP_CHECK(w.dim() == 3, "w must be 3-D [E, K, N], got shape ", w.sizes());
  UNIEP_CHECK(offs.dim() == 1, "offs must be 1-D [E], got shape ", offs.sizes());
  UNIEP_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x.scalar_type());
  UNIEP_CHECK(w.scalar_type() == at::kBFloat16, "w must be bfloat16 like x, got ", w.scalar_type());
  UNIEP_CHECK(offs.scalar_type() == at::kInt, "offs must be int32, got ", offs.scalar_type());
  UNIEP_CHECK(x.device().is_cuda(), "x must be a CUDA tensor, got ", x.device());
  UNIEP_CHECK(w.device() == x.device(), "w must be on x's device ", x.device(), ", got ",
              w.device());
  UNIEP_CHECK(offs.device() == x.device(), "offs must be on x's device ", x.device(), ", got ",
              offs.device());
  UNIEP_CHECK(w.size(0) >= 1, "w must hold at least one expert, got shape ", w.sizes());
  UNIEP_CHECK(offs.size(0) == w.size(0), "offs must have E = w.size(0) = ", w.size(0),
              " entries, got ", offs.size(0));
  UNIEP_CHECK(w.size(1) == x.size(1), "w must be [E, K, N] with K = x.size(1) = ", x.size(1),
              ", got shape ", w.sizes());
  // A copy of a transposed w would cost more than the GEMM: the caller decides.
  UNIEP_CHECK(x.is_contiguous(), "x must be contiguous (row-major [R, K]), got strides ",
              x.strides());
  UNIEP_CHECK(w.is_contiguous(), "w must be contiguous (row-major [E, K, N]), got strides ",
              w.strides());
  UNIEP_CHECK(offs.is_contiguous(), "offs must be contiguous, got strides ", offs.strides());
  UNIEP_CHECK_CODE(x.size(1) % kAlign == 0, StatusCode::kUnsupported,
                   "K = x.size(1) must be a multiple of ", kAlign,
                   " (the grouped GEMM's TMA moves 16-byte rows), got ", x.size(1));
  UNIEP_CHECK_CODE(w.size(2) % kAlign == 0, StatusCode::kUnsupported,
                   "N = w.size(2) must be a multiple of ", kAlign,
                   " (the grouped GEMM's TMA moves 16-byte rows), got ", w.size(2));
}

}  // namespace

namespace {

at::Tensor run_engine(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                      const TuningParams& tuning, cuda::GroupedGemmEpilogue epilogue) {
  check_grouped_mm_args(x, w, offs);
  const bool swiglu = epilogue == cuda::GroupedGemmEpilogue::kSwiGlu;
  if (swiglu)
    UNIEP_CHECK_CODE(w.size(2) % 16 == 0, StatusCode::kUnsupported,
                     "w must be [E, K, 2I] with 2I = w.size(2) a multiple of 16 (gate and up "
                     "interleave in blocks of 8: uniep.gemm.pack_gate_up), got ",
                     w.size(2));
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(2);
  // Rows past offs[E - 1] are not written, as with torch._grouped_mm.
  at::Tensor out = at::empty({rows, swiglu ? n / 2 : n}, x.options());
  if (rows == 0 || n == 0) return out;
  if (k == 0) return out.zero_();  // (with SwiGLU too: silu(0) * 0 = 0)
  const int device = x.device().index();
  UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                   "the grouped GEMM needs a compute capability 9.0 GPU (it is built for "
                   "sm_90a)");
  cuda::GroupedGemmProblem p;
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.offs = offs.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.num_experts = w.size(0);
  p.rows = rows;
  p.k = k;
  p.n = n;
  p.epilogue = epilogue;
  ok_or_throw(cuda::grouped_gemm_supports(p));
  int sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const size_t bytes = cuda::grouped_gemm_workspace_bytes(p.num_experts, sm_count);
  // The caching allocator's blocks are 512-byte aligned, more than the 256 the kernel needs.
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  cuda::GroupedGemmTiles tiles;
  tiles.tile_m = tuning.tile_m;
  tiles.tile_n = tuning.tile_n;
  tiles.tile_k = tuning.tile_k;
  tiles.stages = tuning.stages;
  ok_or_throw(cuda::grouped_gemm_bf16(p, tiles, device, sm_count, workspace.data_ptr(), bytes,
                                      at::cuda::getCurrentCUDAStream(device).stream()));
  return out;
}

}  // namespace

at::Tensor engine_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                             const TuningParams& tuning) {
  return run_engine(x, w, offs, tuning, cuda::GroupedGemmEpilogue::kStore);
}

at::Tensor engine_grouped_mm_swiglu(const at::Tensor& x, const at::Tensor& w_packed,
                                    const at::Tensor& offs, const TuningParams& tuning) {
  return run_engine(x, w_packed, offs, tuning, cuda::GroupedGemmEpilogue::kSwiGlu);
}

namespace {

at::Tensor grouped_mm_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                           c10::string_view tuning) {
  return translate_errors(
      [&] { return engine_grouped_mm(x, w, offs, TuningParams::parse(std::string(tuning))); });
}

at::Tensor grouped_mm_swiglu_cuda(const at::Tensor& x, const at::Tensor& w_packed,
                                  const at::Tensor& offs, c10::string_view tuning) {
  return translate_errors([&] {
    return engine_grouped_mm_swiglu(x, w_packed, offs, TuningParams::parse(std::string(tuning)));
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("grouped_mm", &uniep::torch_glue::grouped_mm_cuda);
  m.impl("grouped_mm_swiglu", &uniep::torch_glue::grouped_mm_swiglu_cuda);
}
