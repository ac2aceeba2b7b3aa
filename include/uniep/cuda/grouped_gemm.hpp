// The expert GEMM engine: bf16 grouped GEMMs for Hopper (sm_90a). The forward has the semantics
// of torch._grouped_mm(x [R, K], w [E, K, N], offs [E]) -> [R, N]: expert e multiplies rows
// [offs[e-1], offs[e]) of x (offs[-1] = 0) by w[e], fp32 accumulation, bf16 out. The backward's
// two products (GroupedGemmKind) run on the same kernels with other operand layouts.
//
// The per-expert row counts stay on the device: a small kernel turns offs into the grouped
// kernel's problem shapes and pointers, in the caller's workspace, on the caller's stream. The
// host never reads them, so a call never waits for the GPU and can be captured in a CUDA graph
// right after the dispatch that produced offs.
//
// Bits: no split-K and no stream-K. Each output element is one fp32 dot product over K in
// ascending K-block order, whatever the grid size, the expert's other rows, or where the row falls
// in a tile; results are identical run to run and for every sm_count.
//
// All pointers are device pointers; arrays are contiguous, row-major. Functions return a Status
// instead of throwing; kInvalidArgument / kUnsupported messages name the argument.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "uniep/status.hpp"

namespace uniep::cuda {

// What the kernel writes.
//   kStore   out [R, n] = x w (fp32 accumulation, rounded once to bf16).
//   kSwiGlu  the first expert GEMM with SwiGLU applied in its epilogue: w's n = 2I columns hold
//            gate and up interleaved in blocks of 8 (columns [16b, 16b + 8) are gate columns
//            8b..8b+7, columns [16b + 8, 16b + 16) up columns 8b..8b+7; n % 16 == 0), and
//            out [R, I] = silu(g) * u with g and u the product's columns rounded to bf16, the
//            activation computed in fp32 and rounded once (the numerics of storing h, then
//            applying SwiGLU). The [R, 2I] product never reaches memory.
//   kSwiGluPlain  kSwiGlu's product and bits with w as the model stores it: gate columns
//            [0, I), up columns [I, 2I) (no packed copy; the kernel's loads read it as if packed
//            in blocks of 64). I = n / 2 must be a multiple of 64, and of tile_n / 2 for the
//            configuration that runs (the automatic choice takes a 128-wide tile where I is not a
//            multiple of 128).
//   kStoreF32  out [R, n] fp32 = x w, the accumulator as is (kForward only): moe_forward's second
//            product under combine=rank_partials, whose partial is then the one rounding.
enum class GroupedGemmEpilogue { kStore, kSwiGlu, kSwiGluPlain, kStoreF32 };

// Which product, over each expert's rows [offs[e-1], offs[e]):
//   kForward  out[rows] = x[rows] w[e]:      x [R, k], w [E, k, n], out [R, n]
//   kDgrad    out[rows] = x[rows] w[e]^T:    x [R, k] (the output's gradient), w [E, n, k] (the
//             forward's weight), out [R, n]: the gradient of the forward's input
//   kWgrad    out[e] = x[rows]^T w[rows]:    x [R, k] (the forward's input), w [R, n] (the
//             output's gradient), out [E, k, n]: the gradient of the forward's weight, summed
//             over the expert's rows in ascending order (no split-K); an expert with no rows
//             gets zeros.
// The tile request (GroupedGemmTiles) applies to kForward; the backward kinds choose by shape
// among their own configurations, kDgrad taking cluster_m for its small-expert tile (compiled in
// clusters of one and two) where it runs that tile. Every kind's bits are independent of the
// configuration.
enum class GroupedGemmKind { kForward, kDgrad, kWgrad };

struct GroupedGemmProblem {
  const void* x = nullptr;        // [rows, k] bf16
  const void* w = nullptr;        // kForward [E, k, n]; kDgrad [E, n, k]; kWgrad [rows, n] bf16
  const int32_t* offs = nullptr;  // [num_experts] int32, cumulative row ends (device memory)
  // kForward / kDgrad: [rows, n] bf16; rows at or past offs[num_experts - 1] are not written (as
  // torch._grouped_mm). kWgrad: [num_experts, k, n].
  void* out = nullptr;
  int64_t num_experts = 0;  // E >= 1
  int64_t rows = 0;         // R: the most rows offs may describe (offs values are clamped to it)
  int64_t k = 0, n = 0;
  // kSwiGlu, kSwiGluPlain: out is [R, n / 2], and the kind must be kForward.
  GroupedGemmEpilogue epilogue = GroupedGemmEpilogue::kStore;
  GroupedGemmKind kind = GroupedGemmKind::kForward;
  // The rows the automatic configuration is chosen for (0: rows). Where rows is a capacity and
  // offs describes fewer (a fused runtime's receive buffer), the expected count keeps the shape
  // rules from pricing empty capacity. Never changes the bits.
  int64_t shape_rows = 0;
};

// Whether `device` can run the kernel (compute capability 9.0: it is built for sm_90a only).
bool grouped_gemm_device_ok(int device);

// OK when the kernel takes this problem; else kInvalidArgument naming the argument and what it
// needs: E >= 1, 0 <= R < 2^31, k and n positive multiples of 8 below 2^31 (TMA moves rows of 16
// bytes; kSwiGlu: n a multiple of 16, kSwiGluPlain: of 128, both kForward only), 16-byte aligned x,
// w and out, a non-null offs. R = 0 needs no x or out (kWgrad: no x or w; out is still written,
// with zeros).
//
// offs is device data and is not checked. The problem kernel makes it safe instead: every offs
// value is clamped to [0, R] and to at least the largest earlier value, so a bad offs gives
// wrong rows, never an access outside x, w or out.
Status grouped_gemm_supports(const GroupedGemmProblem& p);

// One compiled configuration of the kernel: its output tile (tile_m x tile_n), k-step, mainloop
// pipeline depth, thread-block cluster (cluster_m x cluster_n CTAs) and schedule ("cooperative":
// two warpgroups share one tile; "pingpong": each has its own, one's epilogue overlapping the
// other's mainloop). swapped: the kernel computes out^T = w^T x^T (the weights' columns as the
// MMA's M side, tile_m rows as its N side: no padding of an expert's few rows to 64; fp8 plain
// products only). The bits of the result are the same for every configuration.
struct GroupedGemmConfig {
  const char* name = "";
  int tile_m = 0, tile_n = 0, tile_k = 0, stages = 0;
  int cluster_m = 1, cluster_n = 1;
  bool pingpong = false;
  bool swapped = false;
};

// The configurations compiled in, in the order grouped_gemm_select prefers them when several
// match; `count` receives their number.
const GroupedGemmConfig* grouped_gemm_configs(int* count);

// What a caller asks of the configuration; 0 leaves that field to the selection. cluster_m: the
// CTAs along M of the thread-block cluster (TuningParams::cluster).
struct GroupedGemmTiles {
  int tile_m = 0, tile_n = 0, tile_k = 0, stages = 0;
  int cluster_m = 0;
};

// Rows per expert up to which the automatic choice takes the 64-row ping-pong tiles for the SwiGLU
// GEMM and for k <= n on `device` (-1: the current device): 2048 where the memory moves at least
// 4 TB/s (H200), 256 below that (H100), whose 64-row tiles, which load twice the weight bytes
// per FLOP, lost 20-30% against the 128-row ones on experts of 512 and 1024 rows (one H100,
// 2026-11-26, commit 59fa2a5). 2048 when the bandwidth cannot be read.
int64_t grouped_gemm_pingpong_rows(int device = -1);

// The index (into grouped_gemm_configs) of the configuration that runs `p` for the request
// `want`. With every field 0 the choice follows the problem's shape: experts averaging at most
// 128 rows (R / E), or at most grouped_gemm_pingpong_rows(device) with the SwiGLU epilogue or
// k <= n, or n <= 128, take the ping-pong 64-row tiles (64 x 256 when n >= 256); the others the
// cooperative 128 x 256 tiles; with kSwiGluPlain and n / 2 not a multiple of 128, the 128-wide
// tile of the same height instead (64 x 128 x 128 or the cooperative 128 x 128). Otherwise the
// first configuration matching every non-zero field (with kSwiGluPlain, the first whose tile_n / 2
// divides n / 2); none matching is kInvalidArgument listing the valid combinations, and matches
// that all have a tile too wide for kSwiGluPlain are kUnsupported naming one. A tile compiled in
// clusters of one and of two CTAs (64 x 256 ping-pong) takes, with cluster_m 0, the cluster of
// grouped_gemm_auto_cluster (uniep/tuning.hpp): one for experts averaging at most 256 rows.
Status grouped_gemm_select(const GroupedGemmProblem& p, const GroupedGemmTiles& want, int* index,
                           int device = -1);

// Bytes of device workspace grouped_gemm_bf16 needs for `num_experts` groups on a grid of
// `sm_count` SMs, whatever the configuration (per-expert shapes, pointers and strides, and
// per-SM TMA descriptors); 0 if num_experts < 1 or sm_count < 1. It does not depend on R, k, n
// or offs.
size_t grouped_gemm_workspace_bytes(int64_t num_experts, int sm_count);

// Enqueues the problem kernel and the grouped GEMM of the configuration grouped_gemm_select picks
// for `tiles` on `stream`, the GEMM's persistent grid on at most `sm_count` SMs of `device` (the
// current device). Returns without launching anything when R = 0. The workspace (256-byte
// aligned) must stay untouched until the GEMM has run.
Status grouped_gemm_bf16(const GroupedGemmProblem& p, const GroupedGemmTiles& tiles, int device,
                         int sm_count, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);

// The forward in fp8 (e4m3, OCP "fn"): x's rows carry a scale per 1 x 128 block (the format the
// fp8 dispatch sends: x[r, c] ~ x_q[r, c] * x_scales[r, c / 128]) and each expert's weight a scale
// per 128 x 128 block (w[e][c, j] ~ w_q[e][j, c] * w_scales[e][c / 128][j / 128]); the products of
// each 128-deep k-block are scaled and summed in fp32, in one k order (no split-K), and written
// as bf16. Hopper's fp8 tensor cores read both operands K-major, so w_q is stored [E, n, k], the
// transpose of the bf16 weight [E, k, n].
struct GroupedGemmFp8Problem {
  const void* x = nullptr;            // [rows, k] e4m3
  const float* x_scales = nullptr;    // [rows, k / 128]
  const void* w = nullptr;            // [num_experts, n, k] e4m3
  const float* w_scales = nullptr;    // [num_experts, k / 128, n / 128] (swiglu: n / 64)
  const int32_t* offs = nullptr;      // [num_experts] int32, cumulative row ends (device memory)
  void* out = nullptr;                // [rows, n] bf16 (swiglu: [rows, n / 2]; out_f32: fp32)
  int64_t num_experts = 0, rows = 0;  // as GroupedGemmProblem
  int64_t k = 0, n = 0;               // multiples of 128
  // The first expert GEMM with SwiGLU in its epilogue (GroupedGemmEpilogue::kSwiGlu's numerics):
  // out [rows, n / 2] = silu(g) * u, g and u the product's gate and up columns rounded to bf16.
  // w holds w1 [E, 2I, K] with its rows (output columns) packed in blocks of 64: packed row
  // c + 64 g + 128 j (c < 64, g = 0 gate or 1 up) is w1's row g I + 64 j + c; w_scales holds
  // one scale per 64 packed rows, [E, k / 128, n / 64]: the scale of the 128 x 128 block of the
  // unpacked w1 those rows came from. The products, and so the bits, are those of the unpacked
  // w1 with its [E, k / 128, n / 128] scales. Every fp8 configuration has this kernel too.
  bool swiglu = false;
  // The plain product stored in fp32, the accumulator as is: out [rows, n] fp32 (moe_forward's
  // second GEMM under combine=rank_partials). Not with swiglu; not on the swapped tiles.
  bool out_f32 = false;
};

// OK when the fp8 kernel takes the problem: k and n positive multiples of 128, 16-byte aligned
// x, w and out, non-null scales and offs (kUnsupported / kInvalidArgument naming the argument).
Status grouped_gemm_fp8_supports(const GroupedGemmFp8Problem& p);

// Bytes of workspace grouped_gemm_fp8 needs (its per-expert arrays, the rows' scales reordered
// for the kernel, CUTLASS's descriptors); 0 for arguments it refuses.
size_t grouped_gemm_fp8_workspace_bytes(int64_t num_experts, int64_t rows, int64_t k, int sm_count);

// The fp8 configurations compiled in (a 128 x 128 tile, 128 deep, cooperative; 64 x 128,
// ping-pong; 16 x 128 and 32 x 128 with the operands swapped, plain products only), in the order
// grouped_gemm_fp8_select prefers them; `count` receives their number. The bits of the result
// are the same for every configuration.
const GroupedGemmConfig* grouped_gemm_fp8_configs(int* count);

// The index (into grouped_gemm_fp8_configs) of the configuration that runs `p` for the request
// `want`: with every field 0, the rule of p.rows over p.num_experts that
// grouped_gemm_fp8_auto_config (uniep/tuning.hpp) gives (the 64-row ping-pong tiles for experts
// averaging at most 32 rows, as in decode; else the cooperative 128 x 128 tiles); otherwise the
// first configuration matching every non-zero field (for p.swiglu, of those with the SwiGLU
// epilogue: not the swapped ones), none matching being kInvalidArgument listing the valid
// combinations.
Status grouped_gemm_fp8_select(const GroupedGemmFp8Problem& p, const GroupedGemmTiles& want,
                               int* index);

// Enqueues the fp8 grouped GEMM of the configuration grouped_gemm_fp8_select picks for `tiles`
// on `stream` (no host sync; offs read on the device). Without `tiles`: the automatic choice.
Status grouped_gemm_fp8(const GroupedGemmFp8Problem& p, const GroupedGemmTiles& tiles, int device,
                        int sm_count, void* workspace, size_t workspace_bytes, cudaStream_t stream);
Status grouped_gemm_fp8(const GroupedGemmFp8Problem& p, int device, int sm_count, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream);

// act [rows, ffn] = silu(h[:, :ffn]) * h[:, ffn:] for h [rows, 2 ffn] bf16, in fp32, rounded once
// to bf16: the activation between the expert GEMMs when w1 is not packed for kSwiGlu, with the
// same formula (so both give the same bits from the same h). ffn a multiple of 8; h and act
// 16-byte aligned, contiguous.
Status swiglu_bf16(const void* h, int64_t rows, int64_t ffn, void* act, cudaStream_t stream);

// swiglu_bf16's activation quantized for the second fp8 GEMM in the same pass: act [rows][ffn]
// e4m3 and scales [rows][ffn / 128] fp32 (amax / 448 per 128 columns, the fp8 dispatch's
// encoding of the bf16 activation). ffn % 128 == 0; h and act 16-byte aligned.
Status swiglu_fp8(const void* h, int64_t rows, int64_t ffn, void* act, float* scales,
                  cudaStream_t stream);

// swiglu_fp8's encoding of an activation already computed (the SwiGLU epilogue's output,
// GroupedGemmFp8Problem::swiglu): a [rows, cols] bf16 -> q [rows, cols] e4m3 and scales
// [rows, cols / 128]; the same bits as swiglu_fp8 from the h that activation came from.
// cols % 128 == 0; a and q 16-byte aligned.
Status quantize_fp8(const void* a, int64_t rows, int64_t cols, void* q, float* scales,
                    cudaStream_t stream);

// quantize_fp8 of tokens x [tokens, cols] bf16 stored at their GEMM rows: for each entry
// i = t * top_k + k with gemm_row[i] >= 0, q row gemm_row[i] and its scales row get token t's
// encoding (q [rows, cols] e4m3, scales [rows, cols / 128]); rows no entry names are left as
// they were. An entry whose row is >= rows is not stored and recorded in `error` (zeroed by the
// caller) as send_error_word(kSendRowOutOfRange, i) (uniep/send_rows_error.hpp); with `error`
// null it is not stored and not recorded (for rows a plan made, whose own error word covers
// them: no fill of a word nobody reads). The fp8 layer at world 1 quantizes each token once and
// needs its copies in GEMM order: one launch where a quantize and a row copy of the bytes and of
// the scales took three.
Status quantize_fp8_rows(const void* x, int64_t tokens, int64_t cols, const int64_t* gemm_row,
                         int top_k, int64_t rows, void* q, float* scales, unsigned long long* error,
                         cudaStream_t stream);

// The first GEMM's input from a dispatch's receive slots: dst[r] = src[row_slot[r]] for rows of
// cols bf16 (slot s at src + s * src_stride_bytes; a slot outside [0, slots) leaves its row
// unwritten). cols % 8 == 0, src_stride_bytes % 16 == 0, src and dst 16-byte aligned.
Status gather_rows_bf16(const void* src, int64_t src_stride_bytes, int64_t slots,
                        const int64_t* row_slot, int64_t rows, int64_t cols, void* dst,
                        cudaStream_t stream);

// gather_rows_bf16 reading each slot once: the rows are listed by the slot they read (at most
// per_slot of them, per_slot <= 32: a dispatch's top-k), then one warp per slot loads its row
// and stores it to each of them. Every source row crosses DRAM once instead of once per row
// that reads it; the bits are gather_rows_bf16's (a copy). A row past per_slot of its slot (not
// a plan the dispatch makes) is still copied, by a thread of its own. The workspace
// (gather_rows_workspace_bytes, 16-byte aligned) must stay untouched until the copy has run.
size_t gather_rows_workspace_bytes(int64_t slots, int per_slot);
Status gather_rows_bf16(const void* src, int64_t src_stride_bytes, int64_t slots,
                        const int64_t* row_slot, int64_t rows, int64_t cols, int per_slot,
                        void* workspace, size_t workspace_bytes, void* dst, cudaStream_t stream);

// The grouped GEMM's offs from per-expert row counts on the device: offs[e] = counts[0] + ... +
// counts[e], int32, no host sync.
Status expert_offsets(const int64_t* counts, int64_t experts, int32_t* offs, cudaStream_t stream);

// The experts' backward between its grouped GEMMs: one pass over bf16 rows with torch's fp32
// arithmetic (each operation rounded on its own). ffn a multiple of 8, pointers 16-byte aligned,
// contiguous rows. From h [rows, 2 ffn] (gate g, up u), grad_act [rows, ffn] (the gradient of
// the expert's activation before the routing weight: grad_out rows times w2 transposed) and w
// [rows] fp32 (each row's routing weight):
//   sig = 1 / (1 + exp(-g)), act = bf16(g sig u), ga = grad_act w,
//   grad_h = [ga u sig (1 + g (1 - sig)), ga g sig]   ([rows, 2 ffn] bf16),
//   act_w = act w                                     ([rows, ffn] bf16, w2's weight gradient
//                                                      operand),
//   dots = sum_c act grad_act in fp32, fixed order    ([rows], the routing weight's gradient).
// live_rows (optional device word): only rows below min(*live_rows, rows) are computed, for
// buffers sized for the most rows a call may have (the fused backward across ranks).
Status swiglu_backward_bf16(const void* h, const void* grad_act, const float* w, int64_t rows,
                            int64_t ffn, void* act_w, void* grad_h, float* dots,
                            cudaStream_t stream, const int32_t* live_rows = nullptr);

}  // namespace uniep::cuda
