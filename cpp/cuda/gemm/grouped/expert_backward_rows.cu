// The element-wise step of the experts' backward between the engine's grouped GEMMs
// (include/uniep/cuda/grouped_gemm.hpp), one pass over bf16 rows. In torch it was a dozen fp32
// kernels over [R, 2I] and [R, H] temporaries: on a DeepSeek-V3 rank's backward (H100) 9 ms of
// element-wise work beside 13 ms of GEMMs. The arithmetic is torch's, operation
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

// One warp per row; each lane takes 8 columns at a time in ascending order, then a fixed
// butterfly sums the lanes' dots, so the bits never vary run to run. With ga = grad_act * w:
//   sig = 1 / (1 + exp(-g)); act = g * sig * u (rounded to bf16, as the forward's)
//   grad_g = ga * u * sig * (1 + g * (1 - sig)); grad_u = ga * g * sig
//   act_w = act * w; dot += act * grad_act
// grad_act is the gradient before the routing weight, so the weight's gradient <grad_y, y> is
// <act, grad_act> (y = act w2, grad_act = grad_y w2^T): no second pass over y's [R, H] rows.
__global__ void swiglu_backward_kernel(const __nv_bfloat16* __restrict__ h,
                                       const __nv_bfloat16* __restrict__ grad_act,
                                       const float* __restrict__ w, int64_t rows, int64_t ffn,
                                       __nv_bfloat16* __restrict__ act_w,
                                       __nv_bfloat16* __restrict__ grad_h,
                                       float* __restrict__ dots,
                                       const int32_t* __restrict__ live_rows) {
  const int lane = threadIdx.x % 32;
  if (live_rows != nullptr) rows = min(rows, static_cast<int64_t>(max(*live_rows, 0)));
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += warps) {
    const float wr = w[r];
    const __nv_bfloat16* hr = h + r * 2 * ffn;
    __nv_bfloat16* gr = grad_h + r * 2 * ffn;
    float acc = 0.0f;
    for (int64_t c = lane * kVec; c < ffn; c += 32 * kVec) {
      float g[kVec], u[kVec], ga[kVec], a[kVec], aw[kVec], gg[kVec], gu[kVec];
      load8(hr + c, g);
      load8(hr + ffn + c, u);
      load8(grad_act + r * ffn + c, ga);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g[j])));
        a[j] = __bfloat162float(__float2bfloat16_rn(__fmul_rn(__fmul_rn(g[j], sig), u[j])));
        acc = __fadd_rn(acc, __fmul_rn(a[j], ga[j]));
        aw[j] = __fmul_rn(a[j], wr);
        const float gw = __fmul_rn(ga[j], wr);
        const float dsilu = __fadd_rn(1.0f, __fmul_rn(g[j], __fsub_rn(1.0f, sig)));
        gg[j] = __fmul_rn(__fmul_rn(__fmul_rn(gw, u[j]), sig), dsilu);
        gu[j] = __fmul_rn(__fmul_rn(gw, g[j]), sig);
      }
      store8(act_w + r * ffn + c, aw);
      store8(gr + c, gg);
      store8(gr + ffn + c, gu);
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

Status swiglu_backward_bf16(const void* h, const void* grad_act, const float* w, int64_t rows,
                            int64_t ffn, void* act_w, void* grad_h, float* dots,
                            cudaStream_t stream, const int32_t* live_rows) {
  if (Status s = check_rows("swiglu_backward_bf16", rows, ffn); !s.ok()) return s;
  if (rows == 0) return Status::Ok();
  if (!aligned16(h) || !aligned16(grad_act) || !aligned16(act_w) || !aligned16(grad_h))
    return {StatusCode::kUnsupported,
            "swiglu_backward_bf16: h, grad_act, act_w and grad_h must be 16-byte aligned"};
  if (w == nullptr || dots == nullptr)
    return {StatusCode::kInvalidArgument, "swiglu_backward_bf16: w and dots must not be null"};
  swiglu_backward_kernel<<<static_cast<unsigned>(grid_for(rows * 32)), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(h), static_cast<const __nv_bfloat16*>(grad_act), w, rows,
      ffn, static_cast<__nv_bfloat16*>(act_w), static_cast<__nv_bfloat16*>(grad_h), dots,
      live_rows);
  return launch_status("swiglu_backward_bf16");
}

}  // namespace uniep::cuda
