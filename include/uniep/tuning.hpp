// The unified tuning space: every overlap strategy is one point of it.
#pragma once

#include <cstdint>
#include <string>

namespace uniep {

enum class OverlapMode { kSequential, kChunked, kFused };
enum class DispatchPrecision { kBf16, kFp8E4M3 };
// How the combine sums a token's expert outputs.
//   kPerChoice   every (token, k) row goes back to the token's rank, which sums over k in
//                ascending order in fp32: the bits of the design's reference order.
//   kRankPartials the expert rank sums its own k's (ascending, fp32, weights applied) of the
//                second GEMM's fp32 outputs, not rounded, and sends one bf16 partial per (token,
//                rank); the token's rank sums the partials in ascending rank order in fp32. One
//                row per (token, rank) crosses the wire instead of one per (token, k) (4x fewer
//                bytes at top-8 over 2 ranks), and the partial's one rounding replaces the rows'
//                own: per_k's accuracy against float64, in an order of its own.
//   kNodePartials the relay that brought the token into a node sums that node's k's (ascending,
//                fp32, weights applied) and sends one bf16 partial per (token, node) on the rail;
//                the token's rank sums them in ascending node order in fp32 (docs/multinode.md).
//                One row per (token, node) crosses the network. On one node: per_k's bits. The
//                CPU executor, and on CUDA a group that spans nodes (uniep.moe.multinode_cuda).
enum class CombineReduction { kPerChoice, kRankPartials, kNodePartials };
// Which grouped GEMM runs the experts on CUDA: UniEP's own expert GEMM engine, or
// torch._grouped_mm (kept for comparison). The CPU executor ignores it.
enum class GemmEngine { kUniep, kTorch };
// The expert GEMMs' operands. kBf16: bf16 GEMMs (fp8 rows of dispatch=fp8 are decoded to bf16
// first). kFp8: e4m3 GEMMs with fp32 accumulation: the rows as the fp8 dispatch sends them (one
// scale per 1x128 block), the weights quantized from the bf16 ones with one scale per 128 x 128
// block, and the SwiGLU activation (rounded to bf16) quantized like a row for the second GEMM.
// Needs dispatch=fp8 and hidden and the expert FFN size multiples of 128. kAuto (the default):
// kFp8 with dispatch=fp8, else kBf16. The backward differentiates the bf16 layer at the rows
// the experts received (a straight-through estimate of the weights' and activation's rounding).
enum class ExpertPrecision { kAuto, kBf16, kFp8 };

// The keys of the string form, in its order. TuningParams records which of them were given
// (read by parse, or set through a setter), because a key left at its default and the same value
// given mean different requests: overlap=fused named asks for the MegaKernel, while the default
// lets each path pick its own launches.
enum class TuningKey : int {
  kSms,
  kTokenTile,
  kTileM,
  kTileN,
  kTileK,
  kStages,
  kCluster,
  kSkipRounds,
  kOverlap,
  kDispatch,
  kCombine,
  kGemm,
  kExperts,
  kCount
};
const char* tuning_key_name(TuningKey key);
// The key spelled `name` ("sms", "overlap", ...); throws kInvalidArgument listing the keys.
TuningKey tuning_key(const std::string& name);

// One enum key's value alone, read as parse reads it; errors name the key and its spellings.
OverlapMode parse_overlap_mode(const std::string& value);
DispatchPrecision parse_dispatch_precision(const std::string& value);
CombineReduction parse_combine_reduction(const std::string& value);
GemmEngine parse_gemm_engine(const std::string& value);
ExpertPrecision parse_expert_precision(const std::string& value);

const char* overlap_mode_name(OverlapMode mode);
const char* dispatch_precision_name(DispatchPrecision precision);
const char* combine_reduction_name(CombineReduction reduction);
const char* gemm_engine_name(GemmEngine engine);
const char* expert_precision_name(ExpertPrecision precision);

// Printed and parsed as "sms=24/132,token_tile=64,tile_m=auto,...". Keys may appear in any order
// and any subset; missing keys keep their defaults. tile_m, tile_n, tile_k, stages and cluster
// are 0 ("auto") unless given, skip_rounds -1 ("auto"): on CUDA they pick one of the expert GEMM
// engine's compiled configurations (a combination that none has is an error listing them; fp8
// experts pick among the fp8 GEMM's); the CPU executor blocks its loops by the tiles (128, 128,
// 64 when auto) and has no clusters. None of these changes the output bits except
// `dispatch` (fp8 quantises what crosses the wire), `experts` (fp8 expert GEMMs) and `combine`
// (where the sum over k is split), which are numerics choices, not schedules: a tuner must not
// change them, and the bits are identical across every other point of the space for each choice.
struct TuningParams {
  int comm_sms = 24;    // SMs given to dispatch/combine roles
  int total_sms = 0;    // 0: all SMs of the device
  int token_tile = 64;  // tokens per dispatch tile (one signal per tile)
  int tile_m = 0;       // GEMM tile rows (0: auto)
  int tile_n = 0;       // GEMM tile cols (0: auto)
  int tile_k = 0;       // GEMM k-step (0: auto)
  int stages = 0;       // GEMM mainloop pipeline depth (0: auto)
  // CTAs per thread-block cluster along M of the expert GEMM engine's tiles (0: auto, 1 or 2):
  // two CTAs share each weight tile they load, at the price of rounding each expert up to two
  // row tiles (grouped_gemm_auto_cluster). The MegaKernel's tiles fix their own: it takes auto
  // only.
  int cluster = 0;
  // The MegaKernel only (overlap=fused on prepared experts): rounds of GEMM tiles the CTAs that
  // do not send take before the senders join (-1: "auto", the launch's bandwidth model).
  int skip_rounds = -1;
  OverlapMode overlap = OverlapMode::kFused;
  DispatchPrecision dispatch = DispatchPrecision::kBf16;
  CombineReduction combine = CombineReduction::kPerChoice;
  GemmEngine gemm = GemmEngine::kUniep;
  ExpertPrecision experts = ExpertPrecision::kAuto;
  // Bit k: key TuningKey(k) was given. Not part of the value: operator== and to_string ignore it
  // (to_string prints every key, so its parse has them all given).
  uint32_t given_keys = 0;
  bool given(TuningKey key) const { return (given_keys >> static_cast<int>(key)) & 1u; }
  void set_given(TuningKey key) { given_keys |= 1u << static_cast<int>(key); }
  // Whether the experts run in fp8 (ExpertPrecision, kAuto resolved).
  bool fp8_experts() const {
    return experts == ExpertPrecision::kFp8 ||
           (experts == ExpertPrecision::kAuto && dispatch == DispatchPrecision::kFp8E4M3);
  }

  // The tile sizes with auto resolved, for the CPU executor's loops and the plan's row tiles.
  int tile_m_or_default() const { return tile_m != 0 ? tile_m : 128; }
  int tile_n_or_default() const { return tile_n != 0 ? tile_n : 128; }
  int tile_k_or_default() const { return tile_k != 0 ? tile_k : 64; }

  // Every key, or (given_only) the given ones alone: the form that, parsed again, has the same
  // keys given ("" when none is).
  std::string to_string(bool given_only = false) const;
  // Throws uniep::Error naming the key and the expected values.
  static TuningParams parse(const std::string& text);
  void validate() const;

  bool operator==(const TuningParams& o) const;
  bool operator!=(const TuningParams& o) const { return !(*this == o); }
};

// The shape rule of fp8 experts (TuningParams::fp8_experts), the same for every executor: hidden
// and ffn multiples of 128 (whole weight blocks). Throws kInvalidArgument naming both and the way
// back to bf16 experts; does nothing for bf16 experts.
void check_expert_precision(const TuningParams& tuning, int64_t hidden, int64_t ffn);

// The expert GEMM engine's automatic configuration (uniep/cuda/grouped_gemm.hpp's
// grouped_gemm_select with every tile field 0) from the problem's shape alone, so that the tuner's
// cost model (uniep.tune) prices the tiles the engine runs, on every build: the index into the
// engine's compiled configurations, 0 (cooperative 128 x 256 x 64), 1 (ping-pong 64 x 128 x 128)
// or 4 (ping-pong 64 x 256 x 64). rows: R of the grouped problem over num_experts experts;
// swiglu: the gate/up GEMM with the SwiGLU epilogue; pingpong_rows: the device's
// grouped_gemm_pingpong_rows. Throws kInvalidArgument on num_experts or pingpong_rows below 1, or
// a negative rows, n or k.
int grouped_gemm_auto_config(int64_t rows, int64_t num_experts, int64_t n, int64_t k, bool swiglu,
                             int64_t pingpong_rows);

// The cluster (CTAs along M) that the expert GEMM engine's automatic choice gives a tile compiled
// with more than one (TuningParams::cluster auto): 1 where R / E is at most 256 rows, else 2. A
// cluster of two loads each weight tile once for two row tiles but rounds every expert up to two
// of them, which small experts pay for in padding and in fewer, longer units of work. Throws
// kInvalidArgument on num_experts below 1 or a negative rows.
int grouped_gemm_auto_cluster(int64_t rows, int64_t num_experts);

// The MegaKernel's tile width with it left to the launch (FusedMoeLaunch::tile_n 0) for
// `capacity` GEMM rows over num_experts experts of FFN size ffn, tiles of tile_m rows, on
// sm_count SMs: 256 unless the tiles are 64 rows and the rows average at most one tile an expert
// (decode), where 128 (twice the tiles reading weights at once). Then 256 after all where GEMM 1's
// tiles over the most experts a step can touch (min(capacity, num_experts), one row tile each)
// fill more than one round of the SMs at 128 columns and at most one at 256: a second round
// restarts every CTA's weight stream. ffn or sm_count 0: unknown, no such check. Throws
// kInvalidArgument on a negative argument.
int fused_auto_tile_n(int tile_m, int64_t capacity, int64_t num_experts, int64_t ffn = 0,
                      int sm_count = 0);

// The fp8 grouped GEMM's automatic configuration (grouped_gemm_fp8_select with every tile field
// 0) from the problem's shape: the index into grouped_gemm_fp8_configs, 0 (cooperative
// 128 x 128 x 128) or 1 (ping-pong 64 x 128 x 128, where the experts average at most 32 rows).
// rows: R over num_experts experts. Throws kInvalidArgument on num_experts below 1 or a negative
// rows.
int grouped_gemm_fp8_auto_config(int64_t rows, int64_t num_experts);

}  // namespace uniep
