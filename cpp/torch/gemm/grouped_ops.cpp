// CUDA implementation of uniep::grouped_mm (schema in registration.cpp): torch._grouped_mm's
// bf16 (x [R, K], w [E, K, N], offs [E]) -> [R, N] on UniEP's grouped GEMM
// (include/uniep/cuda/grouped_gemm.hpp). No host sync: offs stays on the device.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <tuple>
#include <utility>
#include <vector>

#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/gemm/grouped.hpp"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::torch_glue {
namespace {
constexpr int64_t kAlign = 8;  // bf16 elements in the 16 bytes a TMA row needs
}  // namespace

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
  // A copy of a transposed w would cost more than the GEMM; a w whose [E, N, K] transpose is
  // contiguous (the layout of HF's gate_up_proj) runs as it is, read K-major (engine_grouped_mm).
  UNIEP_CHECK(x.is_contiguous(), "x must be contiguous (row-major [R, K]), got strides ",
              x.strides());
  UNIEP_CHECK(w.is_contiguous() || w.transpose(1, 2).is_contiguous(),
              "w must be contiguous (row-major [E, K, N]) or the transpose of a contiguous "
              "[E, N, K], got strides ",
              w.strides());
  UNIEP_CHECK(offs.is_contiguous(), "offs must be contiguous, got strides ", offs.strides());
  UNIEP_CHECK_CODE(x.size(1) % kAlign == 0, StatusCode::kUnsupported,
                   "K = x.size(1) must be a multiple of ", kAlign,
                   " (the grouped GEMM's TMA moves 16-byte rows), got ", x.size(1));
  UNIEP_CHECK_CODE(w.size(2) % kAlign == 0, StatusCode::kUnsupported,
                   "N = w.size(2) must be a multiple of ", kAlign,
                   " (the grouped GEMM's TMA moves 16-byte rows), got ", w.size(2));
}

void check_swiglu_width(const at::Tensor& w) {
  UNIEP_CHECK_CODE(w.size(2) % 16 == 0, StatusCode::kUnsupported,
                   "w must be [E, K, 2I] with 2I = w.size(2) a multiple of 16 (gate and up "
                   "interleave in blocks of 8: uniep.gemm.pack_gate_up), got ",
                   w.size(2));
}

void check_plain_gate_up(const at::Tensor& w1) {
  UNIEP_CHECK(w1.is_contiguous(),
              "w1 must be contiguous [E, K, 2I] for the SwiGLU epilogue on w1 as stored (its "
              "loads read gate and up column blocks of a row-major w1), got strides ",
              w1.strides());
  UNIEP_CHECK_CODE(w1.size(2) % 128 == 0, StatusCode::kUnsupported,
                   "w1 must be [E, K, 2I] with I = w1.size(2) / 2 a multiple of 64 for the SwiGLU "
                   "epilogue on w1 as stored (its loads read gate and up in blocks of 64 "
                   "columns), got 2I = ",
                   w1.size(2));
}

bool plain_gate_up_ok(const at::Tensor& w1, const TuningParams& tuning) {
  if (w1.dim() != 3 || !w1.is_contiguous() || w1.size(2) % 128 != 0) return false;
  // An explicit tile_n must divide into whole 64-column (gate, up) pairs of the FFN size; the
  // automatic choice finds one (cuda::grouped_gemm_select).
  return tuning.tile_n == 0 || (w1.size(2) / 2) % (tuning.tile_n / 2) == 0;
}

cuda::GroupedGemmProblem forward_problem(const at::Tensor& x, const at::Tensor& w,
                                         const at::Tensor& offs, const at::Tensor& out,
                                         cuda::GroupedGemmEpilogue epilogue) {
  cuda::GroupedGemmProblem p;
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.offs = offs.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.num_experts = w.size(0);
  p.rows = x.size(0);
  p.k = x.size(1);
  p.n = w.size(2);
  p.epilogue = epilogue;
  return p;
}

namespace {

// The backward's operands: dy [R, N] with w [E, K, N] (kDgrad), or x [R, K] with dy [R, N]
// (kWgrad); offs [E] int32 on the same device; all bf16, contiguous, K and N multiples of 8.
void check_backward_args(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                         const char* b_name, const at::Tensor& offs, bool wgrad) {
  UNIEP_CHECK(a.dim() == 2, a_name, " must be 2-D [R, ", wgrad ? "K" : "N", "], got shape ",
              a.sizes());
  UNIEP_CHECK(b.dim() == (wgrad ? 2 : 3), b_name, " must be ",
              wgrad ? "2-D [R, N]" : "3-D [E, K, N]", ", got shape ", b.sizes());
  UNIEP_CHECK(offs.dim() == 1, "offs must be 1-D [E], got shape ", offs.sizes());
  UNIEP_CHECK(a.scalar_type() == at::kBFloat16, a_name, " must be bfloat16, got ", a.scalar_type());
  UNIEP_CHECK(b.scalar_type() == at::kBFloat16, b_name, " must be bfloat16 like ", a_name, ", got ",
              b.scalar_type());
  UNIEP_CHECK(offs.scalar_type() == at::kInt, "offs must be int32, got ", offs.scalar_type());
  UNIEP_CHECK(a.device().is_cuda(), a_name, " must be a CUDA tensor, got ", a.device());
  UNIEP_CHECK(b.device() == a.device(), b_name, " must be on ", a_name, "'s device ", a.device(),
              ", got ", b.device());
  UNIEP_CHECK(offs.device() == a.device(), "offs must be on ", a_name, "'s device ", a.device(),
              ", got ", offs.device());
  UNIEP_CHECK(offs.size(0) >= 1, "offs must have at least one expert, got shape ", offs.sizes());
  if (wgrad) {
    UNIEP_CHECK(b.size(0) == a.size(0), b_name, " must have the R = ", a.size(0), " rows of ",
                a_name, ", got shape ", b.sizes());
  } else {
    UNIEP_CHECK(offs.size(0) == b.size(0), "offs must have E = ", b_name, ".size(0) = ", b.size(0),
                " entries, got ", offs.size(0));
    UNIEP_CHECK(b.size(2) == a.size(1), b_name, " must be [E, K, N] with N = ", a_name,
                ".size(1) = ", a.size(1), ", got shape ", b.sizes());
  }
  UNIEP_CHECK(a.is_contiguous(), a_name, " must be contiguous, got strides ", a.strides());
  UNIEP_CHECK(b.is_contiguous(), b_name, " must be contiguous, got strides ", b.strides());
  UNIEP_CHECK(offs.is_contiguous(), "offs must be contiguous, got strides ", offs.strides());
  const int64_t k = wgrad ? a.size(1) : b.size(1), n = wgrad ? b.size(1) : a.size(1);
  UNIEP_CHECK_CODE(k % kAlign == 0, StatusCode::kUnsupported, "K must be a multiple of ", kAlign,
                   " (the grouped GEMM's TMA moves 16-byte rows), got ", k);
  UNIEP_CHECK_CODE(n % kAlign == 0, StatusCode::kUnsupported, "N must be a multiple of ", kAlign,
                   " (the grouped GEMM's TMA moves 16-byte rows), got ", n);
}

}  // namespace

namespace {

// Runs `p` (pointers, shapes and kind filled in) on the device of `like`, with its workspace.
void launch(cuda::GroupedGemmProblem& p, const at::Tensor& like, const TuningParams& tuning) {
  const int device = like.device().index();
  UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                   "the grouped GEMM needs a compute capability 9.0 GPU (it is built for "
                   "sm_90a)");
  ok_or_throw(cuda::grouped_gemm_supports(p));
  int sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const size_t bytes = cuda::grouped_gemm_workspace_bytes(p.num_experts, sm_count);
  // The caching allocator's blocks are 512-byte aligned, more than the 256 the kernel needs.
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  cuda::GroupedGemmTiles tiles;
  tiles.tile_m = tuning.tile_m;
  tiles.tile_n = tuning.tile_n;
  tiles.tile_k = tuning.tile_k;
  tiles.stages = tuning.stages;
  tiles.cluster_m = tuning.cluster;
  ok_or_throw(cuda::grouped_gemm_bf16(p, tiles, device, sm_count, workspace.data_ptr(), bytes,
                                      at::cuda::getCurrentCUDAStream(device).stream()));
}

at::Tensor run_engine(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                      const TuningParams& tuning, cuda::GroupedGemmEpilogue epilogue) {
  check_grouped_mm_args(x, w, offs);
  const bool f32 = epilogue == cuda::GroupedGemmEpilogue::kStoreF32;
  const bool swiglu = epilogue != cuda::GroupedGemmEpilogue::kStore && !f32;
  if (epilogue == cuda::GroupedGemmEpilogue::kSwiGlu) check_swiglu_width(w);
  if (epilogue == cuda::GroupedGemmEpilogue::kSwiGluPlain) check_plain_gate_up(w);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(2);
  // Rows past offs[E - 1] are not written, as with torch._grouped_mm.
  at::Tensor out =
      at::empty({rows, swiglu ? n / 2 : n}, x.options().dtype(f32 ? at::kFloat : at::kBFloat16));
  if (rows == 0 || n == 0) return out;
  if (k == 0) return out.zero_();  // (with SwiGLU too: silu(0) * 0 = 0)
  cuda::GroupedGemmProblem p = forward_problem(x, w, offs, out, epilogue);
  launch(p, x, tuning);
  return out;
}

}  // namespace

at::Tensor engine_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                             const TuningParams& tuning) {
  if (w.dim() == 3 && !w.is_contiguous() && w.transpose(1, 2).is_contiguous()) {
    // w [E, K, N] viewed from a contiguous [E, N, K]: x w[e] = x (w^T)[e]^T is the data-gradient
    // kind's product, which reads its weight K-major, so no copy is made.
    check_grouped_mm_args(x, w, offs);
    return engine_grouped_mm_dgrad(x, w.transpose(1, 2), offs, tuning);
  }
  return run_engine(x, w, offs, tuning, cuda::GroupedGemmEpilogue::kStore);
}

at::Tensor engine_grouped_mm_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                                 const TuningParams& tuning) {
  // A transposed view runs engine_grouped_mm's data-gradient kind, which stores bf16 only: the
  // fp32 store reads w [E, K, N] contiguous.
  return run_engine(x, w.dim() == 3 ? w.contiguous() : w, offs, tuning,
                    cuda::GroupedGemmEpilogue::kStoreF32);
}

at::Tensor engine_grouped_mm_swiglu(const at::Tensor& x, const at::Tensor& w_packed,
                                    const at::Tensor& offs, const TuningParams& tuning) {
  return run_engine(x, w_packed, offs, tuning, cuda::GroupedGemmEpilogue::kSwiGlu);
}

at::Tensor engine_grouped_mm_swiglu_plain(const at::Tensor& x, const at::Tensor& w1,
                                          const at::Tensor& offs, const TuningParams& tuning) {
  return run_engine(x, w1, offs, tuning, cuda::GroupedGemmEpilogue::kSwiGluPlain);
}

at::Tensor engine_grouped_mm_dgrad(const at::Tensor& dy, const at::Tensor& w,
                                   const at::Tensor& offs, const TuningParams& tuning,
                                   int64_t shape_rows) {
  check_backward_args(dy, "dy", w, "w", offs, false);
  const c10::cuda::CUDAGuard guard(dy.device());
  const int64_t rows = dy.size(0), k = w.size(1), n = w.size(2);
  at::Tensor out = at::empty({rows, k}, dy.options());
  if (rows == 0) return out;
  cuda::GroupedGemmProblem p;
  p.kind = cuda::GroupedGemmKind::kDgrad;
  p.x = dy.data_ptr();
  p.w = w.data_ptr();
  p.offs = offs.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.num_experts = w.size(0);
  p.rows = rows;
  p.k = n;  // the GEMM's K: dy's columns
  p.n = k;  // the GEMM's N: the forward input's columns
  p.shape_rows = shape_rows;
  launch(p, dy, tuning);
  return out;
}

at::Tensor engine_grouped_mm_wgrad(const at::Tensor& x, const at::Tensor& dy,
                                   const at::Tensor& offs, const TuningParams& tuning,
                                   int64_t shape_rows) {
  check_backward_args(x, "x", dy, "dy", offs, true);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t experts = offs.size(0), k = x.size(1), n = dy.size(1);
  at::Tensor out = at::empty({experts, k, n}, x.options());
  cuda::GroupedGemmProblem p;
  p.kind = cuda::GroupedGemmKind::kWgrad;
  p.x = x.size(0) > 0 ? x.data_ptr() : nullptr;
  p.w = dy.size(0) > 0 ? dy.data_ptr() : nullptr;
  p.offs = offs.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.num_experts = experts;
  p.rows = x.size(0);
  p.k = k;
  p.n = n;
  p.shape_rows = shape_rows;
  launch(p, x, tuning);
  return out;
}

at::Tensor engine_grouped_mm_fp8(const at::Tensor& x, const at::Tensor& x_scales,
                                 const at::Tensor& w, const at::Tensor& w_scales,
                                 const at::Tensor& offs, const TuningParams& params, bool swiglu,
                                 bool out_f32) {
  UNIEP_CHECK(x.dim() == 2, "x must be 2-D [R, K], got shape ", x.sizes());
  UNIEP_CHECK(w.dim() == 3, "w must be 3-D [E, N, K] (K-major), got shape ", w.sizes());
  UNIEP_CHECK(offs.dim() == 1, "offs must be 1-D [E], got shape ", offs.sizes());
  UNIEP_CHECK(x.scalar_type() == at::kFloat8_e4m3fn, "x must be float8_e4m3fn, got ",
              x.scalar_type());
  UNIEP_CHECK(w.scalar_type() == at::kFloat8_e4m3fn, "w must be float8_e4m3fn, got ",
              w.scalar_type());
  UNIEP_CHECK(x_scales.scalar_type() == at::kFloat && w_scales.scalar_type() == at::kFloat,
              "x_scales and w_scales must be float32, got ", x_scales.scalar_type(), " and ",
              w_scales.scalar_type());
  UNIEP_CHECK(offs.scalar_type() == at::kInt, "offs must be int32, got ", offs.scalar_type());
  for (const at::Tensor* t : {&x_scales, &w, &w_scales, &offs})
    UNIEP_CHECK(t->device() == x.device(), "every operand must be on x's device ", x.device(),
                ", got ", t->device());
  UNIEP_CHECK(x.device().is_cuda(), "x must be a CUDA tensor, got ", x.device());
  const int64_t rows = x.size(0), k = x.size(1), e = w.size(0), n = w.size(1);
  UNIEP_CHECK(w.size(2) == k, "w must be [E, N, K] with K = x.size(1) = ", k, ", got shape ",
              w.sizes());
  UNIEP_CHECK(offs.size(0) == e, "offs must have E = w.size(0) = ", e, " entries, got ",
              offs.size(0));
  UNIEP_CHECK_CODE(k % 128 == 0 && n % 128 == 0, StatusCode::kUnsupported,
                   "K and N must be multiples of 128 (one scale per 128 x 128 weight block), "
                   "got K = ",
                   k, ", N = ", n);
  UNIEP_CHECK(x_scales.dim() == 2 && x_scales.size(0) == rows && x_scales.size(1) == k / 128,
              "x_scales must be [R, K / 128] = [", rows, ", ", k / 128, "], got shape ",
              x_scales.sizes());
  const int64_t n_block = swiglu ? 64 : 128;  // packed w1: a scale per 64 rows
  UNIEP_CHECK(w_scales.dim() == 3 && w_scales.size(0) == e && w_scales.size(1) == k / 128 &&
                  w_scales.size(2) == n / n_block,
              "w_scales must be [E, K / 128, N / ", n_block, "] = [", e, ", ", k / 128, ", ",
              n / n_block, "], got shape ", w_scales.sizes());
  for (const at::Tensor* t : {&x, &x_scales, &w, &w_scales, &offs})
    UNIEP_CHECK(t->is_contiguous(), "the operands must be contiguous, got strides ", t->strides());
  cuda::GroupedGemmTiles tiles;
  tiles.tile_m = params.tile_m;
  tiles.tile_n = params.tile_n;
  tiles.tile_k = params.tile_k;
  tiles.stages = params.stages;
  tiles.cluster_m = params.cluster;
  const c10::cuda::CUDAGuard guard(x.device());
  UNIEP_CHECK(!(swiglu && out_f32), "the SwiGLU epilogue stores bf16, not fp32");
  at::Tensor out = at::empty({rows, swiglu ? n / 2 : n},
                             x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  cuda::GroupedGemmFp8Problem p;
  p.num_experts = e;
  p.rows = rows;
  p.swiglu = swiglu;
  p.out_f32 = out_f32;
  int index = 0;  // a tile request no configuration has is an error, rows or none
  ok_or_throw(cuda::grouped_gemm_fp8_select(p, tiles, &index));
  if (rows == 0) return out;
  const int device = x.device().index();
  UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                   "the grouped GEMM needs a compute capability 9.0 GPU (it is built for "
                   "sm_90a)");
  p.x = x.data_ptr();
  p.x_scales = x_scales.data_ptr<float>();
  p.w = w.data_ptr();
  p.w_scales = w_scales.data_ptr<float>();
  p.offs = offs.data_ptr<int32_t>();
  p.out = out.data_ptr();
  p.k = k;
  p.n = n;
  ok_or_throw(cuda::grouped_gemm_fp8_supports(p));
  int sm_count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  const size_t bytes = cuda::grouped_gemm_fp8_workspace_bytes(e, rows, k, sm_count);
  at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
  ok_or_throw(cuda::grouped_gemm_fp8(p, tiles, device, sm_count, workspace.data_ptr(), bytes,
                                     at::cuda::getCurrentCUDAStream(device).stream()));
  return out;
}

std::tuple<at::Tensor, at::Tensor> engine_swiglu_fp8(const at::Tensor& h) {
  UNIEP_CHECK(h.dim() == 2, "h must be 2-D [R, 2I], got shape ", h.sizes());
  UNIEP_CHECK(h.scalar_type() == at::kBFloat16, "h must be bfloat16, got ", h.scalar_type());
  UNIEP_CHECK(h.is_cuda(), "h must be a CUDA tensor, got ", h.device());
  UNIEP_CHECK(h.is_contiguous(), "h must be contiguous, got strides ", h.strides());
  const int64_t rows = h.size(0), ffn = h.size(1) / 2;
  // A shape error like the CPU kernel's (uniep/gemm.py), so both raise ValueError.
  UNIEP_CHECK(h.size(1) % 256 == 0,
              "h must be [R, 2I] with I a multiple of 128 (one scale per 128 columns), got shape ",
              h.sizes());
  const c10::cuda::CUDAGuard guard(h.device());
  at::Tensor act = at::empty({rows, ffn}, h.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::empty({rows, ffn / 128}, h.options().dtype(at::kFloat));
  ok_or_throw(cuda::swiglu_fp8(h.data_ptr(), rows, ffn, act.data_ptr(), scales.data_ptr<float>(),
                               at::cuda::getCurrentCUDAStream(h.device().index()).stream()));
  return std::make_tuple(act, scales);
}

namespace {

// The rows the fp8 encodings take (quantize_fp8, quantize_fp8_rows); the messages name them x.
void check_quantize_input(const at::Tensor& x) {
  UNIEP_CHECK(x.dim() == 2, "x must be 2-D [R, K], got shape ", x.sizes());
  UNIEP_CHECK(x.scalar_type() == at::kBFloat16, "x must be bfloat16, got ", x.scalar_type());
  UNIEP_CHECK(x.is_cuda(), "x must be a CUDA tensor, got ", x.device());
  UNIEP_CHECK(x.is_contiguous(), "x must be contiguous, got strides ", x.strides());
  UNIEP_CHECK(x.size(1) % 128 == 0,
              "x must have a multiple of 128 columns (one scale per 128), got shape ", x.sizes());
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> engine_quantize_fp8(const at::Tensor& a) {
  check_quantize_input(a);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor q = at::empty(a.sizes(), a.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::empty({a.size(0), a.size(1) / 128}, a.options().dtype(at::kFloat));
  ok_or_throw(cuda::quantize_fp8(a.data_ptr(), a.size(0), a.size(1), q.data_ptr(),
                                 scales.data_ptr<float>(),
                                 at::cuda::getCurrentCUDAStream(a.device().index()).stream()));
  return std::make_tuple(q, scales);
}

namespace {

// out_dtype: bf16 (the default) or float32 (the accumulator as is).
bool f32_out(std::optional<at::ScalarType> out_dtype) {
  const at::ScalarType t = out_dtype.value_or(at::kBFloat16);
  UNIEP_CHECK(t == at::kBFloat16 || t == at::kFloat, "out_dtype must be bfloat16 or float32, got ",
              t);
  return t == at::kFloat;
}

at::Tensor grouped_mm_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                           c10::string_view tuning, std::optional<at::ScalarType> out_dtype) {
  return translate_errors([&] {
    const TuningParams params = TuningParams::parse(std::string(tuning));
    return f32_out(out_dtype) ? engine_grouped_mm_f32(x, w, offs, params)
                              : engine_grouped_mm(x, w, offs, params);
  });
}

at::Tensor grouped_mm_swiglu_cuda(const at::Tensor& x, const at::Tensor& w_packed,
                                  const at::Tensor& offs, c10::string_view tuning) {
  return translate_errors([&] {
    return engine_grouped_mm_swiglu(x, w_packed, offs, TuningParams::parse(std::string(tuning)));
  });
}

at::Tensor grouped_mm_swiglu_plain_cuda(const at::Tensor& x, const at::Tensor& w1,
                                        const at::Tensor& offs, c10::string_view tuning) {
  return translate_errors([&] {
    return engine_grouped_mm_swiglu_plain(x, w1, offs, TuningParams::parse(std::string(tuning)));
  });
}

at::Tensor grouped_mm_fp8_cuda(const at::Tensor& x, const at::Tensor& x_scales, const at::Tensor& w,
                               const at::Tensor& w_scales, const at::Tensor& offs,
                               c10::string_view tuning, std::optional<at::ScalarType> out_dtype) {
  return translate_errors([&] {
    return engine_grouped_mm_fp8(x, x_scales, w, w_scales, offs,
                                 TuningParams::parse(std::string(tuning)), false,
                                 f32_out(out_dtype));
  });
}

at::Tensor grouped_mm_fp8_swiglu_cuda(const at::Tensor& x, const at::Tensor& x_scales,
                                      const at::Tensor& w_packed, const at::Tensor& w_scales,
                                      const at::Tensor& offs, c10::string_view tuning) {
  return translate_errors([&] {
    return engine_grouped_mm_fp8(x, x_scales, w_packed, w_scales, offs,
                                 TuningParams::parse(std::string(tuning)), true, false);
  });
}

std::tuple<at::Tensor, at::Tensor> swiglu_fp8_cuda(const at::Tensor& h) {
  return translate_errors([&] { return engine_swiglu_fp8(h); });
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8_cuda(const at::Tensor& x) {
  return translate_errors([&] { return engine_quantize_fp8(x); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_fp8_rows_cuda(const at::Tensor& x,
                                                                      const at::Tensor& gemm_row,
                                                                      bool report) {
  return translate_errors([&] {
    check_quantize_input(x);
    UNIEP_CHECK(gemm_row.dim() == 2 && gemm_row.size(0) == x.size(0) && gemm_row.size(1) >= 1,
                "gemm_row must be [T = ", x.size(0), ", top_k >= 1], got shape ", gemm_row.sizes());
    check_exactly(gemm_row, "gemm_row", at::kLong, gemm_row.sizes(), x);
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0) * gemm_row.size(1);
    at::Tensor q = at::empty({rows, x.size(1)}, x.options().dtype(at::kFloat8_e4m3fn));
    at::Tensor scales = at::empty({rows, x.size(1) / 128}, x.options().dtype(at::kFloat));
    // Without report no word is filled: one launch fewer in a decode step.
    at::Tensor error = report ? at::zeros({1}, x.options().dtype(at::kLong))
                              : at::empty({0}, x.options().dtype(at::kLong));
    ok_or_throw(cuda::quantize_fp8_rows(
        x.data_ptr(), x.size(0), x.size(1), gemm_row.data_ptr<int64_t>(),
        static_cast<int>(gemm_row.size(1)), rows, q.data_ptr(), scales.data_ptr<float>(),
        report ? reinterpret_cast<unsigned long long*>(error.data_ptr<int64_t>()) : nullptr,
        at::cuda::getCurrentCUDAStream(x.device().index()).stream()));
    return std::make_tuple(q, scales, error);
  });
}

// The bf16 CUDA rows the backward's element-wise kernels take: 2-D, contiguous, on one device.
void check_bf16_rows(const at::Tensor& t, const char* name) {
  UNIEP_CHECK(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  UNIEP_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
  UNIEP_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
  UNIEP_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  UNIEP_CHECK(t.size(1) % 8 == 0, name, " must have a multiple of 8 columns, got shape ",
              t.sizes());
}

cudaStream_t stream_of(const at::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& h,
                                                                    const at::Tensor& grad_act,
                                                                    const at::Tensor& w) {
  return translate_errors([&] {
    check_bf16_rows(h, "h");
    check_bf16_rows(grad_act, "grad_act");
    const int64_t rows = h.size(0), ffn = h.size(1) / 2;
    UNIEP_CHECK(grad_act.size(0) == rows && h.size(1) == 2 * grad_act.size(1),
                "h must be [R, 2I] for grad_act [R, I] = ", grad_act.sizes(), ", got ", h.sizes());
    UNIEP_CHECK(grad_act.device() == h.device(), "grad_act must be on h's device ", h.device(),
                ", got ", grad_act.device());
    UNIEP_CHECK(w.dim() == 1 && w.size(0) == rows, "w must be [R] = [", rows, "], got shape ",
                w.sizes());
    UNIEP_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.device() == h.device(),
                "w must be contiguous float32 on h's device ", h.device(), ", got ",
                w.scalar_type(), " on ", w.device());
    const c10::cuda::CUDAGuard guard(h.device());
    at::Tensor act_w = at::empty({rows, ffn}, h.options());
    at::Tensor grad_h = at::empty_like(h);
    at::Tensor dots = at::empty({rows}, h.options().dtype(at::kFloat));
    ok_or_throw(cuda::swiglu_backward_bf16(h.data_ptr(), grad_act.data_ptr(), w.data_ptr<float>(),
                                           rows, ffn, act_w.data_ptr(), grad_h.data_ptr(),
                                           dots.data_ptr<float>(), stream_of(h)));
    return std::make_tuple(act_w, grad_h, dots);
  });
}

at::Tensor grouped_mm_dgrad_cuda(const at::Tensor& dy, const at::Tensor& w, const at::Tensor& offs,
                                 c10::string_view tuning) {
  return translate_errors([&] {
    return engine_grouped_mm_dgrad(dy, w, offs, TuningParams::parse(std::string(tuning)));
  });
}

at::Tensor grouped_mm_wgrad_cuda(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offs,
                                 c10::string_view tuning) {
  return translate_errors([&] {
    return engine_grouped_mm_wgrad(x, dy, offs, TuningParams::parse(std::string(tuning)));
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("grouped_mm", &uniep::torch_glue::grouped_mm_cuda);
  m.impl("grouped_mm_swiglu", &uniep::torch_glue::grouped_mm_swiglu_cuda);
  m.impl("grouped_mm_swiglu_plain", &uniep::torch_glue::grouped_mm_swiglu_plain_cuda);
  m.impl("grouped_mm_dgrad", &uniep::torch_glue::grouped_mm_dgrad_cuda);
  m.impl("grouped_mm_fp8", &uniep::torch_glue::grouped_mm_fp8_cuda);
  m.impl("grouped_mm_fp8_swiglu", &uniep::torch_glue::grouped_mm_fp8_swiglu_cuda);
  m.impl("swiglu_fp8", &uniep::torch_glue::swiglu_fp8_cuda);
  m.impl("quantize_fp8", &uniep::torch_glue::quantize_fp8_cuda);
  m.impl("quantize_fp8_rows", &uniep::torch_glue::quantize_fp8_rows_cuda);
  m.impl("swiglu_backward", &uniep::torch_glue::swiglu_backward_cuda);
  m.impl("grouped_mm_wgrad", &uniep::torch_glue::grouped_mm_wgrad_cuda);
}
