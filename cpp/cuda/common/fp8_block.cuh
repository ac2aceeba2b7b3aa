// The e4m3 encoding of a 128-column block, in one place for everything that must produce the
// same bytes: the fp8 dispatch's rows and the fp8 experts' activation (and uniep.gemm.quantize_rows
// on the CPU). scale = amax / 448 and q = RNE(v * (448 / amax)), saturated; an all-zero block
// gets scale 1 and zeros. The lanes that share a block reduce their amax with a butterfly.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace uniep::cuda {

constexpr int kFp8Block = 128;  // columns per scale
constexpr float kE4m3Max = 448.0f;

// The block's amax, from each of kLanes consecutive lanes' own (aligned groups of a warp; every
// lane of the warp must call it).
template <int kLanes>
__device__ __forceinline__ float block_amax(float amax) {
#pragma unroll
  for (int m = kLanes / 2; m > 0; m >>= 1)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  return amax;
}

__device__ __forceinline__ float e4m3_scale(float amax) {
  return amax > 0.0f ? __fdiv_rn(amax, kE4m3Max) : 1.0f;
}

// v's kN values encoded with the block's amax, into kN bytes at q.
template <int kN>
__device__ __forceinline__ void encode_e4m3(const float (&v)[kN], float amax, uint8_t* q) {
  const float inv = amax > 0.0f ? __fdiv_rn(kE4m3Max, amax) : 1.0f;
#pragma unroll
  for (int j = 0; j < kN; ++j)
    q[j] = __nv_cvt_float_to_fp8(__fmul_rn(v[j], inv), __NV_SATFINITE, __NV_E4M3);
}

}  // namespace uniep::cuda
