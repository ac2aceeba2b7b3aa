// Argument checks shared by the CPU and CUDA implementations of the uniep ops. Every message
// names the argument and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>

#include "uniep/cpu_executor.hpp"
#include "uniep/shape.hpp"
#include "uniep/status.hpp"

namespace uniep::torch_glue {

DType to_dtype(const at::Tensor& t, const char* name);

struct MoeInputs {
  MoeShape shape;
  DType dtype = DType::kFloat32;
  DType weight_dtype = DType::kFloat32;
};

MoeInputs validate_moe_inputs(const at::Tensor& x, const at::Tensor& topk_idx,
                              const at::Tensor& topk_weights, const at::Tensor& w1,
                              const at::Tensor& w2, int64_t world_size, int64_t rank);

void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name);

void check_topk_idx(const at::Tensor& topk_idx);

// Runs fn, turning uniep::Error into the torch error Python users expect: ValueError for bad
// arguments, RuntimeError otherwise.
[[noreturn]] void rethrow_as_torch_error(const Error& e);
template <typename Fn>
auto translate_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    rethrow_as_torch_error(e);
  }
}

}  // namespace uniep::torch_glue
