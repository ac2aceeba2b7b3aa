#include "torch/common/validate.hpp"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <vector>

namespace uniep::torch_glue {

namespace {
std::string shape_str(const at::Tensor& t) {
  return detail::str_cat(t.sizes());
}

int64_t normalize_dim(int64_t dim, int64_t rank, const char* name) {
  UNIEP_CHECK(dim >= -rank && dim < rank, name, " must be in [", -rank, ", ", rank,
              ") for a tensor of ", rank, " dimensions, got ", dim);
  return dim < 0 ? dim + rank : dim;
}
}  // namespace

void rethrow_as_torch_error(const Error& e) {
  if (e.code() == StatusCode::kInvalidArgument) TORCH_CHECK_VALUE(false, e.what());
  if (e.code() == StatusCode::kUnsupported) TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
  TORCH_CHECK(false, "uniep ", status_code_name(e.code()), ": ", e.what());
}

DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kFloat64;
    case at::kHalf:
      UNIEP_CHECK(false, name,
                  " must be float32, bfloat16 or float64, got float16: the expert kernels have no "
                  "float16 path (cast to bfloat16: same size, wider range)");
      break;
    default:
      UNIEP_CHECK(false, name, " must be float32, bfloat16 or float64, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref,
                const char* ref_name) {
  UNIEP_CHECK(t.sizes() == ref.sizes(), name, " must have the shape of ", ref_name, " ",
              shape_str(ref), ", got ", shape_str(t));
  UNIEP_CHECK(t.scalar_type() == ref.scalar_type(), name, " must have the dtype of ", ref_name,
              " (", ref.scalar_type(), "), got ", t.scalar_type());
  UNIEP_CHECK(t.device() == ref.device(), name, " must be on ", ref_name, "'s device ",
              ref.device(), ", got ", t.device());
  UNIEP_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_exactly(const at::Tensor& t, const char* name, at::ScalarType dtype,
                   at::IntArrayRef shape, const at::Tensor& like) {
  UNIEP_CHECK(t.scalar_type() == dtype && t.sizes() == shape, name, " must be ", dtype, " ", shape,
              ", got ", t.scalar_type(), " ", t.sizes());
  UNIEP_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ",
              t.device());
  UNIEP_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

void check_w1_as_stored(int64_t ffn, int64_t tile_n) {
  const int64_t half = tile_n == 128 ? 64 : 128;
  UNIEP_CHECK_CODE(ffn % half == 0, StatusCode::kUnsupported,
                   "w1_as_stored needs ffn (w2.size(1)) to be a multiple of ", half, " (each ",
                   2 * half, "-wide tile of the fused kernel's first GEMM reads ", half,
                   " gate and ", half, " up columns), got ", ffn,
                   "; pass w1 in uniep.gemm.pack_gate_up's layout instead");
}

void check_fused_tile_n(int64_t tile_n, int64_t tile_m) {
  UNIEP_CHECK(tile_n == 0 || tile_n == 256 || (tile_n == 128 && tile_m == 64),
              "tile_n must be 0 (auto), 256, or with tile_m 64 also 128 (the fused kernel's "
              "tile columns), got tile_n ",
              tile_n, " with tile_m ", tile_m);
}

void check_trace(const std::optional<at::Tensor>& trace, int64_t sms, const at::Tensor& like) {
  if (!trace.has_value()) return;
  UNIEP_CHECK(
      trace->dim() == 1 && trace->scalar_type() == at::kLong && trace->size(0) >= 4 * sms &&
          trace->device() == like.device() && trace->is_contiguous(),
      "trace must be contiguous int64 with >= 4 x SMs = ", 4 * sms,
      " entries (6 x SMs: also the gates' waits; 12 x SMs at world 1: also the tile stamps) on ",
      like.device(), ", got ", trace->scalar_type(), " ", trace->sizes(), " on ", trace->device());
}

void check_topk_idx(const at::Tensor& topk_idx) {
  UNIEP_CHECK(topk_idx.dim() == 2, "topk_idx must be a 2-D tensor [T, K], got shape ",
              shape_str(topk_idx));
  UNIEP_CHECK(topk_idx.scalar_type() == at::kLong, "topk_idx must be int64, got ",
              topk_idx.scalar_type());
  UNIEP_CHECK(topk_idx.size(1) >= 1, "topk_idx must have at least one column (top-k >= 1)");
  UNIEP_CHECK(topk_idx.is_contiguous(), "topk_idx must be contiguous");
}

namespace {
// w1 / w2 on an executor: any strides on CPU, contiguous on CUDA (torch._grouped_mm there).
void check_weight_layout(const at::Tensor& w, const char* name, const char* shape,
                         Executor executor) {
  if (executor == Executor::kCpu || w.is_contiguous()) return;
  UNIEP_CHECK(false, name, " must be contiguous ", shape,
              " on CUDA (the expert GEMMs read it row-major), got strides ", w.strides(),
              "; strided views are read in place by the CPU executor only: pass ", name,
              ".contiguous() once, outside the step");
}
}  // namespace

MoeInputs validate_moe_inputs(const at::Tensor& x, const at::Tensor& topk_idx,
                              const at::Tensor& topk_weights, const at::Tensor& w1,
                              const at::Tensor& w2, int64_t world_size, int64_t rank,
                              Executor executor) {
  MoeInputs in;
  UNIEP_CHECK(x.dim() == 2, "x must be a 2-D tensor [T, H], got shape ", shape_str(x));
  in.dtype = to_dtype(x, "x");
  UNIEP_CHECK(x.is_contiguous(), "x must be contiguous");
  UNIEP_CHECK(x.size(1) > 0, "x must have a non-empty hidden dimension, got shape ", shape_str(x));
  const int64_t T = x.size(0), H = x.size(1);

  check_topk_idx(topk_idx);
  UNIEP_CHECK(topk_idx.size(0) == T, "topk_idx must have T = ", T, " rows like x, got shape ",
              shape_str(topk_idx));
  UNIEP_CHECK(topk_idx.device() == x.device(), "topk_idx must be on x's device ", x.device(),
              ", got ", topk_idx.device());

  UNIEP_CHECK(topk_weights.sizes() == topk_idx.sizes(),
              "topk_weights must have the shape of topk_idx ", shape_str(topk_idx), ", got ",
              shape_str(topk_weights));
  const at::ScalarType wt = topk_weights.scalar_type();
  UNIEP_CHECK(wt != at::kHalf,
              "topk_weights must be float32 or bfloat16, got float16: the executors read "
              "float32 or bfloat16 routing weights (cast the [T, K] weights to float32)");
  if (executor == Executor::kCuda) {
    UNIEP_CHECK(wt == at::kFloat, "topk_weights must be float32 on CUDA (the dispatch sends fp32 ",
                "weights; uniep.moe_forward casts bfloat16 ones), got ", wt);
  } else {
    UNIEP_CHECK(wt == at::kFloat || wt == at::kBFloat16 ||
                    (wt == at::kDouble && x.scalar_type() == at::kDouble),
                "topk_weights must be float32 or bfloat16 (float64 only with float64 x), got ", wt);
  }
  in.weight_dtype = to_dtype(topk_weights, "topk_weights");
  UNIEP_CHECK(topk_weights.device() == x.device(), "topk_weights must be on x's device ",
              x.device(), ", got ", topk_weights.device());
  UNIEP_CHECK(topk_weights.is_contiguous(), "topk_weights must be contiguous");

  UNIEP_CHECK(w1.dim() == 3, "w1 must be a 3-D tensor [E_local, H, 2*I], got shape ",
              shape_str(w1));
  UNIEP_CHECK(w1.scalar_type() == x.scalar_type(), "w1 must have x's dtype ", x.scalar_type(),
              ", got ", w1.scalar_type());
  UNIEP_CHECK(w1.size(0) >= 1, "w1 must hold at least one local expert, got shape ", shape_str(w1));
  UNIEP_CHECK(w1.size(1) == H, "w1 must be [E_local, H = ", H, ", 2*I], got shape ", shape_str(w1));
  UNIEP_CHECK(w1.size(2) > 0 && w1.size(2) % 2 == 0,
              "w1's last dimension must be 2*I (gate and up), an even number > 0, got shape ",
              shape_str(w1));
  UNIEP_CHECK(w1.device() == x.device(), "w1 must be on x's device ", x.device(), ", got ",
              w1.device());
  check_weight_layout(w1, "w1", "[E_local, H, 2*I]", executor);
  const int64_t El = w1.size(0), I = w1.size(2) / 2;

  UNIEP_CHECK(w2.dim() == 3, "w2 must be a 3-D tensor [E_local, I, H], got shape ", shape_str(w2));
  UNIEP_CHECK(w2.scalar_type() == x.scalar_type(), "w2 must have x's dtype ", x.scalar_type(),
              ", got ", w2.scalar_type());
  UNIEP_CHECK(w2.size(0) == El && w2.size(1) == I && w2.size(2) == H, "w2 must be [E_local = ", El,
              ", I = ", I, ", H = ", H, "] to match w1 ", shape_str(w1), ", got shape ",
              shape_str(w2));
  UNIEP_CHECK(w2.device() == x.device(), "w2 must be on x's device ", x.device(), ", got ",
              w2.device());
  check_weight_layout(w2, "w2", "[E_local, I, H]", executor);

  in.shape.tokens = T;
  in.shape.hidden = H;
  in.shape.ffn_hidden = I;
  in.shape.top_k = topk_idx.size(1);
  in.shape.world_size = world_size;
  in.shape.rank = rank;
  in.shape.num_experts = El * world_size;
  in.shape.validate();
  return in;
}

void check_executor_device(const at::Tensor& t, const char* name, Executor executor) {
  if (executor == Executor::kCpu)
    UNIEP_CHECK(t.device().is_cpu(), name, " must be a CPU tensor for the CPU executor, got ",
                t.device());
  else
    UNIEP_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
}

void check_matmul_operands(const at::Tensor& a, const at::Tensor& b, const char* a_shape,
                           const char* b_shape, Executor executor) {
  UNIEP_CHECK(a.dim() == 2, "a must be a 2-D tensor ", a_shape, ", got shape ", shape_str(a));
  to_dtype(a, "a");
  check_executor_device(a, "a", executor);
  UNIEP_CHECK(b.dim() == 2, "b must be a 2-D tensor ", b_shape, ", got shape ", shape_str(b));
  UNIEP_CHECK(b.scalar_type() == a.scalar_type(), "b must have a's dtype ", a.scalar_type(),
              ", got ", b.scalar_type());
  check_executor_device(b, "b", executor);
  // Always true on CPU (one device); on CUDA the GEMM runs on a's GPU.
  UNIEP_CHECK(b.device() == a.device(), "b must be on a's device ", a.device(), ", got ",
              b.device());
  UNIEP_CHECK(b.size(0) == a.size(1), "b must be ", b_shape, " with K = a.size(1) = ", a.size(1),
              " rows, got shape ", shape_str(b));
}

void check_rows_input(const at::Tensor& x, Executor executor) {
  UNIEP_CHECK(x.dim() >= 1,
              "x must have at least 1 dimension (dim 0 is split across ranks), got a 0-d tensor");
  to_dtype(x, "x");
  check_executor_device(x, "x", executor);
}

int64_t row_width(const at::Tensor& x) {
  int64_t w = 1;
  for (int64_t d = 1; d < x.dim(); ++d) w *= x.size(d);
  return w;
}

at::Tensor empty_with_rows(const at::Tensor& x, int64_t rows) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  return at::empty(shape, x.options());
}

int64_t matmul_reduce_scatter_rows(const at::Tensor& a, int64_t world_size) {
  UNIEP_CHECK(a.size(0) % world_size == 0, "a.size(0) (M = ", a.size(0),
              ") must be divisible by the world size ", world_size);
  return a.size(0) / world_size;
}

int64_t reduce_scatter_rows(const at::Tensor& x, int64_t world_size) {
  UNIEP_CHECK(x.size(0) % world_size == 0, "x.size(0) (", x.size(0),
              ") must be divisible by the world size ", world_size);
  return x.size(0) / world_size;
}

void check_ulysses_input(const at::Tensor& x, Executor executor) {
  UNIEP_CHECK(x.dim() >= 2,
              "x must have at least 2 dimensions (one to scatter, one to gather), got shape ",
              shape_str(x));
  to_dtype(x, "x");
  check_executor_device(x, "x", executor);
}

UlyssesDims ulysses_dims(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim) {
  UlyssesDims d;
  d.scatter = normalize_dim(scatter_dim, x.dim(), "scatter_dim");
  d.gather = normalize_dim(gather_dim, x.dim(), "gather_dim");
  return d;
}

UlyssesLayout ulysses_tensor_layout(const at::Tensor& x, const UlyssesDims& dims,
                                    int64_t world_size) {
  return ulysses_layout(x.sizes().vec(), dims.scatter, dims.gather, world_size, x.element_size());
}

}  // namespace uniep::torch_glue
