// The element-wise steps of the experts' backward between the engine's grouped GEMMs
// (include/uniep/cuda/grouped_gemm.hpp), each one pass over bf16 rows. In torch they were a
// dozen fp32 kernels over [R, 2I] and [R, H] temporaries: on a DeepSeek-V3 rank's backward
// (H100) 9 ms of element-wise work beside 13 ms of GEMMs. The arithmetic is torch's, operation
// by operation in fp32 (each product and sum rounded on its own, no FMA contraction), so the
// gradients are those of the unfused chain.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda {
namespace {

constexpr int kVec = 8;  // bf16 values per 16-byte vector
constexpr int kThreads = 256;

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&v)[kVec]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = __bfloat162float(b[j]);
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[kVec]) {
  uint4 raw;
  auto* b = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < kVec; ++j) b[j] = __float2bfloat16_rn(v[j]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// One thread per 8 columns of the activation: g, u from h, grad_act; act, grad_g, grad_u out.
//   sig = 1 / (1 + exp(-g)); act = g * sig * u
//   grad_g = grad_act * u * sig * (1 + g * (1 - sig)); grad_u = grad_act * g * sig
__global__ void swiglu_backward_kernel(const __nv_bfloat16* __restrict__ h,
                                       const __nv_bfloat16* __restrict__ grad_act, int64_t rows,
                                       int64_t ffn, __nv_bfloat16* __restrict__ act,
                                       __nv_bfloat16* __restrict__ grad_h) {
  const int64_t per_row = ffn / kVec, total = rows * per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / per_row, c = (v % per_row) * kVec;
    float g[kVec], u[kVec], ga[kVec], a[kVec], gg[kVec], gu[kVec];
    load8(h + r * 2 * ffn + c, g);
    load8(h + r * 2 * ffn + ffn + c, u);
    load8(grad_act + r * ffn + c, ga);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g[j])));
      a[j] = __fmul_rn(__fmul_rn(g[j], sig), u[j]);
      const float dsilu = __fadd_rn(1.0f, __fmul_rn(g[j], __fsub_rn(1.0f, sig)));
      gg[j] = __fmul_rn(__fmul_rn(__fmul_rn(ga[j], u[j]), sig), dsilu);
      gu[j] = __fmul_rn(__fmul_rn(ga[j], g[j]), sig);
    }
    store8(act + r * ffn + c, a);
    store8(grad_h + r * 2 * ffn + c, gg);
    store8(grad_h + r * 2 * ffn + ffn + c, gu);
  }
}

// out[r] = bf16(x[r] * w[r]): one thread per 8 columns.
__global__ void scale_rows_kernel(const __nv_bfloat16* __restrict__ x, const float* __restrict__ w,
                                  int64_t rows, int64_t cols, __nv_bfloat16* __restrict__ out) {
  const int64_t per_row = cols / kVec, total = rows * per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / per_row, c = (v % per_row) * kVec;
    float a[kVec];
    load8(x + r * cols + c, a);
    const float s = w[r];
#pragma unroll
    for (int j = 0; j < kVec; ++j) a[j] = __fmul_rn(a[j], s);
    store8(out + r * cols + c, a);
  }
}

// dots[r] = sum_c a[r, c] * b[r, c] in fp32: one warp per row, each lane summing its columns in
// ascending order, then a fixed butterfly over the lanes, so the bits never vary run to run.
__global__ void row_dots_kernel(const __nv_bfloat16* __restrict__ a,
                                const __nv_bfloat16* __restrict__ b, int64_t rows, int64_t cols,
                                float* __restrict__ dots) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += warps) {
    float acc = 0.0f;
    for (int64_t c = lane * kVec; c < cols; c += 32 * kVec) {
      float x[kVec], y[kVec];
      load8(a + r * cols + c, x);
      load8(b + r * cols + c, y);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc = __fadd_rn(acc, __fmul_rn(x[j], y[j]));
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, m));
    if (lane == 0) dots[r] = acc;
  }
}

bool aligned16(const void* p) {
  return p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

Status check_rows(const char* what, int64_t rows, int64_t cols) {
  if (rows < 0)
    return {StatusCode::kInvalidArgument, detail::str_cat(what, ": rows must be >= 0, got ", rows)};
  if (cols < 1 || cols % kVec != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat(what, ": the row length must be a positive multiple of ", kVec,
                            ", got ", cols)};
  return Status::Ok();
}

int64_t grid_for(int64_t work) {
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, 132 * 16));
}

}  // namespace

Status swiglu_backward_bf16(const void* h, const void* grad_act, int64_t rows, int64_t ffn,
                            void* act, void* grad_h, cudaStream_t stream) {
  if (Status s = check_rows("swiglu_backward_bf16", rows, ffn); !s.ok()) return s;
  if (rows == 0) return Status::Ok();
  if (!aligned16(h) || !aligned16(grad_act) || !aligned16(act) || !aligned16(grad_h))
    return {StatusCode::kUnsupported,
            "swiglu_backward_bf16: h, grad_act, act and grad_h must be 16-byte aligned"};
  swiglu_backward_kernel<<<static_cast<unsigned>(grid_for(rows * (ffn / kVec))), kThreads, 0,
                           stream>>>(
      static_cast<const __nv_bfloat16*>(h), static_cast<const __nv_bfloat16*>(grad_act), rows, ffn,
      static_cast<__nv_bfloat16*>(act), static_cast<__nv_bfloat16*>(grad_h));
  return launch_status("swiglu_backward_bf16");
}

Status scale_rows_bf16(const void* x, const float* w, int64_t rows, int64_t cols, void* out,
                       cudaStream_t stream) {
  if (Status s = check_rows("scale_rows_bf16", rows, cols); !s.ok()) return s;
  if (rows == 0) return Status::Ok();
  if (!aligned16(x) || !aligned16(out) || w == nullptr)
    return {StatusCode::kUnsupported, "scale_rows_bf16: x and out must be 16-byte aligned"};
  scale_rows_kernel<<<static_cast<unsigned>(grid_for(rows * (cols / kVec))), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), w, rows, cols, static_cast<__nv_bfloat16*>(out));
  return launch_status("scale_rows_bf16");
}

Status row_dots_bf16(const void* a, const void* b, int64_t rows, int64_t cols, float* dots,
                     cudaStream_t stream) {
  if (Status s = check_rows("row_dots_bf16", rows, cols); !s.ok()) return s;
  if (rows == 0) return Status::Ok();
  if (!aligned16(a) || !aligned16(b) || dots == nullptr)
    return {StatusCode::kUnsupported, "row_dots_bf16: a and b must be 16-byte aligned"};
  row_dots_kernel<<<static_cast<unsigned>(grid_for(rows * 32)), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), rows, cols, dots);
  return launch_status("row_dots_bf16");
}

}  // namespace uniep::cuda
