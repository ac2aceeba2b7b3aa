// Expert weights in UniEP's fp8 format, made on the host: what uniep::cuda::MoeLayer's fp8
// experts read (MoeLayerConfig::fp8_experts, fp8_w1_packed), the layout of uniep.moe.prepared's
// "fp8" experts. A server quantizes its bf16 checkpoint once with these (or loads weights made by
// uniep.gemm.quantize_expert_weights and uniep.gemm.pack_gate_up_fp8, which run the same layout
// functions) and copies the result to the device.
#pragma once

#include <cstdint>

namespace uniep {

// One fp32 scale per kFp8WeightBlock x kFp8WeightBlock block of a weight.
inline constexpr int64_t kFp8WeightBlock = 128;
// w1 packed for the first fp8 GEMM's SwiGLU epilogue: blocks of this many gate rows, then as many
// up rows (gate column c and up column c 64 tile columns apart, in one 128-wide tile).
inline constexpr int64_t kGateUpPackRows = 64;

// w [E][K][N] bf16 bit patterns (the layer's w1 [E][hidden][2 ffn] or w2 [E][ffn][hidden]; K and
// N multiples of 128) -> q [E][N][K] e4m3 (OCP "fn") stored K-major, as Hopper's fp8 tensor cores
// read it, and scales [E][K / 128][N / 128]. Each 128 x 128 block's scale is its amax / 448 (1 for
// an all-zero block); its values times 448 / amax are rounded to the nearest e4m3, ties to even,
// saturated at 448: the rounding of the CPU executor's fp8 experts. uniep::Error
// (kInvalidArgument) names a bad argument.
void quantize_expert_weights_fp8(const uint16_t* w, int64_t experts, int64_t k, int64_t n,
                                 uint8_t* q, float* scales);

// The row of w1 [2 ffn][K] (gate rows [0, ffn), then up rows) that row `packed_row` of the packed
// w1 holds: packed row c + 64 g + 128 j is row g ffn + 64 j + c (c < 64, g 0 for the gate and 1
// for the up, j < ffn / 64). ffn must be a multiple of 64.
int64_t gate_up_source_row(int64_t packed_row, int64_t ffn);

// The 128-row scale block of w1 that the packed 64-row group `packed_group` (packed rows
// [64 packed_group, 64 packed_group + 64)) came from: each group keeps that block's scales.
int64_t gate_up_source_block(int64_t packed_group, int64_t ffn);

// q1 [E][2 ffn][K] e4m3 and s1 [E][K / 128][2 ffn / 128] (quantize_expert_weights_fp8 of w1)
// -> q [E][2 ffn][K] with the rows of gate_up_source_row and s [E][K / 128][2 ffn / 64] with a
// scale per packed 64-row group (gate_up_source_block). The values are not touched: the fp8 GEMM
// with SwiGLU in its epilogue on the packed weights gives the bits of the plain fp8 GEMM followed
// by SwiGLU. ffn a multiple of 64, K of 128; q and s must not overlap q1 and s1.
void pack_gate_up_fp8(const uint8_t* q1, const float* s1, int64_t experts, int64_t ffn, int64_t k,
                      uint8_t* q, float* s);

}  // namespace uniep
