// Argument checks shared by the CPU and CUDA implementations of the uniep ops. Every message
// names the argument and what was expected.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <utility>

#include "uniep/collectives.hpp"
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

void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name);

// t is `dtype` of exactly `shape`, contiguous, on like's device; the messages name `name`.
void check_exactly(const at::Tensor& t, const char* name, at::ScalarType dtype,
                   at::IntArrayRef shape, const at::Tensor& like);

// The fused kernels' optional phase trace: contiguous int64 with 4 entries per SM, on like's
// device.
void check_trace(const std::optional<at::Tensor>& trace, int64_t sms, const at::Tensor& like);

// The fused kernels' w1 as stored (w1_as_stored): ffn a multiple of 128, each 256-wide tile of
// GEMM 1 reading 128 gate and 128 up columns, or of 64 with tile_n 128 (kUnsupported otherwise,
// naming pack_gate_up).
void check_w1_as_stored(int64_t ffn, int64_t tile_n = 0);

// The fused kernel's tile columns (cuda::FusedMoeLaunch::tile_n): 0, 256, or 128 with tile_m 64.
void check_fused_tile_n(int64_t tile_n, int64_t tile_m);

void check_topk_idx(const at::Tensor& topk_idx);

// ---- collectives: the checks their CPU and CUDA implementations share ----
// The tensor checks and the checks against the world size are separate calls because the CUDA
// ops learn the world size from their runtime, which they look up after the tensor checks.

// Where an op's executor reads its tensors.
enum class Executor { kCpu, kCuda };

void check_executor_device(const at::Tensor& t, const char* name, Executor executor);

// a and b of the GEMM collectives: 2-D, a float dtype, one dtype and device, b.size(0) ==
// a.size(1). a_shape and b_shape ("[M/W, K]") name the layout the op expects.
void check_matmul_operands(const at::Tensor& a, const at::Tensor& b, const char* a_shape,
                           const char* b_shape, Executor executor);

// x of all_gather / reduce_scatter: at least 1-D, a float dtype.
void check_rows_input(const at::Tensor& x, Executor executor);

// Elements of one row of dim 0 (1 for a 1-D tensor).
int64_t row_width(const at::Tensor& x);

// An empty tensor like x with `rows` rows in dim 0.
at::Tensor empty_with_rows(const at::Tensor& x, int64_t rows);

// The rows of this rank's output, M / world size, where a is matmul_reduce_scatter's [M, K_local].
int64_t matmul_reduce_scatter_rows(const at::Tensor& a, int64_t world_size);

// The rows of this rank's output, x.size(0) / world size, for reduce_scatter.
int64_t reduce_scatter_rows(const at::Tensor& x, int64_t world_size);

// x of all_to_all_ulysses: at least 2-D, a float dtype.
void check_ulysses_input(const at::Tensor& x, Executor executor);

struct UlyssesDims {
  int64_t scatter = 0;
  int64_t gather = 0;
};

// The dims normalised to [0, x.dim()) (negative ones count from the end); ulysses_layout checks
// that they differ and that the scatter dim splits evenly.
UlyssesDims ulysses_dims(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim);

// Where the blocks lie in x (made contiguous by the caller) and the output (uniep::
// ulysses_layout): both executors move them with this geometry, so their results are the same
// bits.
UlyssesLayout ulysses_tensor_layout(const at::Tensor& x, const UlyssesDims& dims,
                                    int64_t world_size);

// moe_forward / moe_backward's arguments. The CPU executor reads w1 / w2 through their strides
// and bfloat16 topk_weights (promoted to fp32 as it reads them); the CUDA executor needs both
// weights contiguous and float32 topk_weights, and its errors say so.
MoeInputs validate_moe_inputs(const at::Tensor& x, const at::Tensor& topk_idx,
                              const at::Tensor& topk_weights, const at::Tensor& w1,
                              const at::Tensor& w2, int64_t world_size, int64_t rank,
                              Executor executor);

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
