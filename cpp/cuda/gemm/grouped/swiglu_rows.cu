// swiglu_bf16 (include/uniep/cuda/grouped_gemm.hpp): the activation between the two expert
// GEMMs when w1 is not packed for the SwiGLU epilogue, in one pass over h instead of torch's
// silu and multiply kernels (which also round silu(g) to bf16 before the product).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda {
namespace {

constexpr int kVec = 8;  // bf16 values per 16-byte load

// One thread per 8 activation columns of one row: two 16-byte loads (gate and up), one store.
__global__ void swiglu_rows_kernel(const __nv_bfloat16* __restrict__ h, int64_t rows, int64_t ffn,
                                   __nv_bfloat16* __restrict__ act) {
  const int64_t vecs_per_row = ffn / kVec;
  const int64_t total = rows * vecs_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / vecs_per_row, c = (v % vecs_per_row) * kVec;
    const uint4 g4 = *reinterpret_cast<const uint4*>(h + r * 2 * ffn + c);
    const uint4 u4 = *reinterpret_cast<const uint4*>(h + r * 2 * ffn + ffn + c);
    const auto* g = reinterpret_cast<const __nv_bfloat162*>(&g4);
    const auto* u = reinterpret_cast<const __nv_bfloat162*>(&u4);
    uint4 out;
    auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const float2 gf = __bfloat1622float2(g[i]), uf = __bfloat1622float2(u[i]);
      // The SwiGLU epilogue's formula, so packed and unpacked w1 give the same activation.
      o[i] = __floats2bfloat162_rn(gf.x / (1.0f + expf(-gf.x)) * uf.x,
                                   gf.y / (1.0f + expf(-gf.y)) * uf.y);
    }
    *reinterpret_cast<uint4*>(act + r * ffn + c) = out;
  }
}

}  // namespace

Status swiglu_bf16(const void* h, int64_t rows, int64_t ffn, void* act, cudaStream_t stream) {
  if (rows < 0)
    return {StatusCode::kInvalidArgument, detail::str_cat("rows must be >= 0, got ", rows)};
  if (ffn < 1 || ffn % kVec != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat("ffn must be a positive multiple of ", kVec, ", got ", ffn)};
  if (rows == 0) return Status::Ok();
  if (h == nullptr || act == nullptr || reinterpret_cast<uintptr_t>(h) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(act) % 16 != 0)
    return {StatusCode::kUnsupported, "h and act must be 16-byte aligned (non-null)"};
  const int64_t total = rows * (ffn / kVec);
  const int threads = 256;
  // Enough blocks to fill the GPU several times over; the loop strides over the rest.
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 132 * 16);
  swiglu_rows_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(h), rows, ffn, static_cast<__nv_bfloat16*>(act));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("swiglu_bf16 failed to launch: ", cudaGetErrorString(e))};
  return Status::Ok();
}

}  // namespace uniep::cuda
