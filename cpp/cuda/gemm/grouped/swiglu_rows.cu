// swiglu_bf16 and swiglu_fp8 (include/uniep/cuda/grouped_gemm.hpp): the activation between the
// two expert GEMMs when w1 is not packed for the SwiGLU epilogue, in one pass over h instead of
// torch's silu and multiply kernels (which also round silu(g) to bf16 before the product); the
// fp8 one also quantizes it for the second fp8 GEMM in the same pass. Both compute silu_mul
// (common/swiglu_math.cuh), the SwiGLU epilogue's formula, so packed and unpacked w1 give the
// same activation.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/fp8_block.cuh"
#include "cuda/common/swiglu_math.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/send_rows_error.hpp"

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
      o[i] = __floats2bfloat162_rn(silu_mul(gf.x, uf.x), silu_mul(gf.y, uf.y));
    }
    *reinterpret_cast<uint4*>(act + r * ffn + c) = out;
  }
}

constexpr int kFp8Cols = 16;  // activation columns per lane
constexpr int kFp8Lanes = kFp8Block / kFp8Cols;

// One lane per 16 activation columns, eight lanes per 128-column scale block. Each value is
// swiglu_bf16's (rounded to bf16), then encoded as the fp8 dispatch encodes a bf16 row
// (common/fp8_block.cuh; uniep.gemm.quantize_rows on the CPU). ffn % 128 == 0,
// so a warp's 32 lanes cover whole scale blocks; every lane runs every step (the shuffles name
// the whole warp), those past the end with zeros and no stores.
// kSwiGlu false: h is the activation itself, [rows, ffn] bf16 (the SwiGLU epilogue's output),
// encoded the same way (quantize_fp8). With `to` (quantize_fp8_rows), row r is stored at each of
// its top_k destinations instead of at r.
struct RowTargets {
  const int64_t* gemm_row = nullptr;  // [rows][top_k]; null: row r goes to row r
  int top_k = 1;
  int64_t rows = 0;                     // the outputs' rows
  unsigned long long* error = nullptr;  // null: a row past `rows` is skipped unrecorded
};

template <bool kSwiGlu>
__global__ void swiglu_fp8_kernel(const __nv_bfloat16* __restrict__ h, int64_t rows, int64_t ffn,
                                  uint8_t* __restrict__ act, float* __restrict__ scales,
                                  RowTargets to) {
  // Launched while the kernel ahead (the plan, GEMM 1) may still run: h and the rows are read
  // after this.
  wait_for_prior_grid();
  allow_next_grid();
  const int64_t lanes_per_row = ffn / kFp8Cols, total = rows * lanes_per_row;
  const int lane = threadIdx.x % 32;
  const int64_t warp0 = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32 * 32;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = warp0; base < total; base += stride) {
    const int64_t v = base + lane;
    const bool in = v < total;
    const int64_t r = in ? v / lanes_per_row : 0, c = in ? (v % lanes_per_row) * kFp8Cols : 0;
    float a[kFp8Cols];
    float amax = 0.0f;
    if (in && kSwiGlu) {
      uint4 g4[2], u4[2];
      g4[0] = *reinterpret_cast<const uint4*>(h + r * 2 * ffn + c);
      g4[1] = *reinterpret_cast<const uint4*>(h + r * 2 * ffn + c + 8);
      u4[0] = *reinterpret_cast<const uint4*>(h + r * 2 * ffn + ffn + c);
      u4[1] = *reinterpret_cast<const uint4*>(h + r * 2 * ffn + ffn + c + 8);
      const auto* g = reinterpret_cast<const __nv_bfloat16*>(g4);
      const auto* u = reinterpret_cast<const __nv_bfloat16*>(u4);
#pragma unroll
      for (int j = 0; j < kFp8Cols; ++j) {
        a[j] = __bfloat162float(
            __float2bfloat16_rn(silu_mul(__bfloat162float(g[j]), __bfloat162float(u[j]))));
        amax = fmaxf(amax, fabsf(a[j]));
      }
    } else if (in) {
      uint4 a4[2];
      a4[0] = *reinterpret_cast<const uint4*>(h + r * ffn + c);
      a4[1] = *reinterpret_cast<const uint4*>(h + r * ffn + c + 8);
      const auto* v = reinterpret_cast<const __nv_bfloat16*>(a4);
#pragma unroll
      for (int j = 0; j < kFp8Cols; ++j) {
        a[j] = __bfloat162float(v[j]);
        amax = fmaxf(amax, fabsf(a[j]));
      }
    }
    amax = block_amax<kFp8Lanes>(amax);
    if (!in) continue;
    uint4 packed;
    encode_e4m3(a, amax, reinterpret_cast<uint8_t*>(&packed));
    const float scale = e4m3_scale(amax);
    auto store = [&](int64_t d) {
      *reinterpret_cast<uint4*>(act + d * ffn + c) = packed;
      if (lane % kFp8Lanes == 0) scales[d * (ffn / kFp8Block) + c / kFp8Block] = scale;
    };
    if (to.gemm_row == nullptr) {
      store(r);
      continue;
    }
    for (int k = 0; k < to.top_k; ++k) {
      const int64_t i = r * to.top_k + k, d = to.gemm_row[i];
      if (d < 0) continue;
      if (d < to.rows) {
        store(d);
      } else if (c == 0 && to.error != nullptr) {  // once per entry: its row's first lane
        atomicCAS(to.error, 0ull,
                  static_cast<unsigned long long>(send_error_word(kSendRowOutOfRange, i)));
      }
    }
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
  return launch_status("swiglu_bf16");
}

namespace {

template <bool kSwiGlu>
Status launch_fp8_rows(const void* h, int64_t rows, int64_t ffn, void* act, float* scales,
                       cudaStream_t stream, const char* name, RowTargets to = {}) {
  if (rows < 0)
    return {StatusCode::kInvalidArgument, detail::str_cat(name, ": rows must be >= 0, got ", rows)};
  if (ffn < 1 || ffn % kFp8Block != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat(name, ": the activation's columns must be a positive multiple of ",
                            kFp8Block, " (one scale per 128 columns), got ", ffn)};
  if (rows == 0) return Status::Ok();
  if (h == nullptr || act == nullptr || scales == nullptr ||
      reinterpret_cast<uintptr_t>(h) % 16 != 0 || reinterpret_cast<uintptr_t>(act) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(scales) % 4 != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat(name,
                            ": the input and the e4m3 output must be 16-byte aligned, the "
                            "scales 4 (non-null)")};
  const int64_t total = rows * (ffn / kFp8Cols);
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((total + threads - 1) / threads, 132 * 16);
  // A failed launch leaves its error for launch_status.
  (void)launch_after_prior(swiglu_fp8_kernel<kSwiGlu>, dim3(static_cast<unsigned>(blocks)),
                           dim3(threads), 0, stream, static_cast<const __nv_bfloat16*>(h), rows,
                           ffn, static_cast<uint8_t*>(act), scales, to);
  return launch_status(name);
}

}  // namespace

Status swiglu_fp8(const void* h, int64_t rows, int64_t ffn, void* act, float* scales,
                  cudaStream_t stream) {
  return launch_fp8_rows<true>(h, rows, ffn, act, scales, stream, "swiglu_fp8");
}

Status quantize_fp8(const void* a, int64_t rows, int64_t cols, void* q, float* scales,
                    cudaStream_t stream) {
  return launch_fp8_rows<false>(a, rows, cols, q, scales, stream, "quantize_fp8");
}

Status quantize_fp8_rows(const void* x, int64_t tokens, int64_t cols, const int64_t* gemm_row,
                         int top_k, int64_t rows, void* q, float* scales, unsigned long long* error,
                         cudaStream_t stream) {
  if (top_k < 1 || rows < 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("quantize_fp8_rows: top_k must be >= 1 and rows >= 0, got ", top_k,
                            " and ", rows)};
  if (tokens > 0 && gemm_row == nullptr)
    return {StatusCode::kInvalidArgument, "quantize_fp8_rows: gemm_row must be a device pointer"};
  RowTargets to;
  to.gemm_row = gemm_row;
  to.top_k = top_k;
  to.rows = rows;
  to.error = error;
  return launch_fp8_rows<false>(x, tokens, cols, q, scales, stream, "quantize_fp8_rows", to);
}

}  // namespace uniep::cuda
