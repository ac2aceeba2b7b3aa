#include "torch/validate.hpp"

#include <c10/util/Exception.h>

namespace uniep::torch_glue {

namespace {
std::string shape_str(const at::Tensor& t) {
  return detail::str_cat(t.sizes());
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

void check_topk_idx(const at::Tensor& topk_idx) {
  UNIEP_CHECK(topk_idx.dim() == 2, "topk_idx must be a 2-D tensor [T, K], got shape ",
              shape_str(topk_idx));
  UNIEP_CHECK(topk_idx.scalar_type() == at::kLong, "topk_idx must be int64, got ",
              topk_idx.scalar_type());
  UNIEP_CHECK(topk_idx.size(1) >= 1, "topk_idx must have at least one column (top-k >= 1)");
  UNIEP_CHECK(topk_idx.is_contiguous(), "topk_idx must be contiguous");
}

MoeInputs validate_moe_inputs(const at::Tensor& x, const at::Tensor& topk_idx,
                              const at::Tensor& topk_weights, const at::Tensor& w1,
                              const at::Tensor& w2, int64_t world_size, int64_t rank) {
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
  UNIEP_CHECK(topk_weights.scalar_type() == at::kFloat ||
                  (topk_weights.scalar_type() == at::kDouble && x.scalar_type() == at::kDouble),
              "topk_weights must be float32 (or float64 with float64 x), got ",
              topk_weights.scalar_type());
  in.weight_dtype = topk_weights.scalar_type() == at::kDouble ? DType::kFloat64 : DType::kFloat32;
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
  UNIEP_CHECK(w1.is_contiguous(), "w1 must be contiguous");
  const int64_t El = w1.size(0), I = w1.size(2) / 2;

  UNIEP_CHECK(w2.dim() == 3, "w2 must be a 3-D tensor [E_local, I, H], got shape ", shape_str(w2));
  UNIEP_CHECK(w2.scalar_type() == x.scalar_type(), "w2 must have x's dtype ", x.scalar_type(),
              ", got ", w2.scalar_type());
  UNIEP_CHECK(w2.size(0) == El && w2.size(1) == I && w2.size(2) == H, "w2 must be [E_local = ", El,
              ", I = ", I, ", H = ", H, "] to match w1 ", shape_str(w1), ", got shape ",
              shape_str(w2));
  UNIEP_CHECK(w2.device() == x.device(), "w2 must be on x's device ", x.device(), ", got ",
              w2.device());
  UNIEP_CHECK(w2.is_contiguous(), "w2 must be contiguous");

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

}  // namespace uniep::torch_glue
