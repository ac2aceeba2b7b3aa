// UniEP's grouped GEMM on torch tensors, for the ops that run experts (moe_forward) as well as
// uniep::grouped_mm itself. CUDA builds only.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/tuning.hpp"

namespace uniep::torch_glue {

// The operand checks of uniep::grouped_mm (x [R, K], w [E, K, N] or the transpose of a contiguous
// [E, N, K], offs [E] int32, bf16 on one CUDA device, K and N multiples of 8); throws naming the
// argument.
void check_grouped_mm_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs);

// The SwiGLU epilogue's width check: w [E, K, 2I] with 2I a multiple of 16.
void check_swiglu_width(const at::Tensor& w);
// w1 [E, K, 2I] for the SwiGLU epilogue on w1 as stored: contiguous, I a multiple of 64.
void check_plain_gate_up(const at::Tensor& w1);
// Whether engine_grouped_mm_swiglu_plain takes w1 under tuning: check_plain_gate_up's
// conditions, and an explicit tile_n whose half divides I.
bool plain_gate_up_ok(const at::Tensor& w1, const TuningParams& tuning);

// The forward problem x [R, K] w [E, K, N] -> out (offs's experts), for the engine's entry points;
// the tensors are checked already.
cuda::GroupedGemmProblem forward_problem(const at::Tensor& x, const at::Tensor& w,
                                         const at::Tensor& offs, const at::Tensor& out,
                                         cuda::GroupedGemmEpilogue epilogue);

// torch._grouped_mm's bf16 (x [R, K], w [E, K, N], offs [E] int32) -> [R, N] on the expert GEMM
// engine, the configuration picked from tuning's tile_m, tile_n, tile_k and stages (all auto:
// by shape). Throws uniep::Error naming the argument for operands the kernel does not take.
at::Tensor engine_grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                             const TuningParams& tuning);

// engine_grouped_mm's product stored in fp32, the accumulator as is (moe_forward's second GEMM
// under combine=rank_partials). A w that is not contiguous is copied first.
at::Tensor engine_grouped_mm_f32(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                                 const TuningParams& tuning);

// The first expert GEMM with SwiGLU in its epilogue: w_packed [E, K, 2I] holds gate and up
// interleaved in blocks of 8 columns (include/uniep/cuda/grouped_gemm.hpp, kSwiGlu); returns
// act [R, I] = silu(gate) * up.
at::Tensor engine_grouped_mm_swiglu(const at::Tensor& x, const at::Tensor& w_packed,
                                    const at::Tensor& offs, const TuningParams& tuning);
// The same activation, bit for bit, from w1 as stored (gate columns [0, I), then up; kSwiGluPlain):
// no packed copy of w1. I must be a multiple of 64 (check_plain_gate_up).
at::Tensor engine_grouped_mm_swiglu_plain(const at::Tensor& x, const at::Tensor& w1,
                                          const at::Tensor& offs, const TuningParams& tuning);

// The backward's products: dy [R, N] w[e]^T -> [R, K] for w [E, K, N] (the input's gradient),
// and x[rows of e]^T dy[rows of e] -> [E, K, N] (the weight's gradient; zeros for an expert with
// no rows), summed over the rows in ascending order. shape_rows: the rows offs is expected to
// describe where R is a capacity (GroupedGemmProblem::shape_rows; 0: R).
at::Tensor engine_grouped_mm_dgrad(const at::Tensor& dy, const at::Tensor& w,
                                   const at::Tensor& offs, const TuningParams& tuning,
                                   int64_t shape_rows = 0);
at::Tensor engine_grouped_mm_wgrad(const at::Tensor& x, const at::Tensor& dy,
                                   const at::Tensor& offs, const TuningParams& tuning,
                                   int64_t shape_rows = 0);

// The fp8 grouped GEMM: x [R, K] e4m3 with x_scales [R, K / 128], w [E, N, K] e4m3 (K-major)
// with w_scales [E, K / 128, N / 128] -> [R, N] bf16; tuning's tile keys pick the configuration.
// swiglu: the first expert GEMM with SwiGLU in its epilogue on w1 packed by pack_gate_up_fp8,
// w_scales [E, K / 128, N / 64] -> the activation [R, N / 2] bf16
// (cuda::GroupedGemmFp8Problem::swiglu). out_f32: the plain product [R, N] in fp32, the
// accumulator as is (not with swiglu).
at::Tensor engine_grouped_mm_fp8(const at::Tensor& x, const at::Tensor& x_scales,
                                 const at::Tensor& w, const at::Tensor& w_scales,
                                 const at::Tensor& offs, const TuningParams& tuning,
                                 bool swiglu = false, bool out_f32 = false);

// a [R, C] bf16 -> (e4m3 [R, C], fp32 scales [R, C / 128]): swiglu_fp8's encoding of an
// activation already computed, and the quantize_fp8 op's of rows (its errors name the op's x).
std::tuple<at::Tensor, at::Tensor> engine_quantize_fp8(const at::Tensor& a);

// h [R, 2I] bf16 (gate, then up) -> silu(gate) * up rounded to bf16 and quantized in 1 x 128
// blocks: (e4m3 [R, I], fp32 scales [R, I / 128]).
std::tuple<at::Tensor, at::Tensor> engine_swiglu_fp8(const at::Tensor& h);

}  // namespace uniep::torch_glue
