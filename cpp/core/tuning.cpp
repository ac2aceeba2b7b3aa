#include "uniep/tuning.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <limits>

#include "uniep/shape.hpp"
#include "uniep/status.hpp"

namespace uniep {

namespace {

// One spelling of an enum key's value; `listed` is false for an alias the error leaves out.
template <class E>
struct Spelling {
  const char* text;
  E value;
  bool listed = true;
};

constexpr Spelling<OverlapMode> kOverlapSpellings[] = {{"sequential", OverlapMode::kSequential},
                                                       {"chunked", OverlapMode::kChunked},
                                                       {"fused", OverlapMode::kFused}};
constexpr Spelling<DispatchPrecision> kDispatchSpellings[] = {
    {"bf16", DispatchPrecision::kBf16},
    {"fp8", DispatchPrecision::kFp8E4M3},
    {"fp8_e4m3", DispatchPrecision::kFp8E4M3, false}};
constexpr Spelling<CombineReduction> kCombineSpellings[] = {
    {"per_k", CombineReduction::kPerChoice},
    {"rank_partials", CombineReduction::kRankPartials},
    {"node_partials", CombineReduction::kNodePartials}};
constexpr Spelling<GemmEngine> kGemmSpellings[] = {{"uniep", GemmEngine::kUniep},
                                                   {"torch", GemmEngine::kTorch}};
constexpr Spelling<ExpertPrecision> kExpertSpellings[] = {{"auto", ExpertPrecision::kAuto},
                                                          {"bf16", ExpertPrecision::kBf16},
                                                          {"fp8", ExpertPrecision::kFp8}};

// The value's first listed spelling: the name the string form prints and parse reads back.
template <class E, size_t N>
const char* name_of(E value, const Spelling<E> (&spellings)[N]) {
  for (const auto& s : spellings)
    if (s.listed && s.value == value) return s.text;
  return "?";
}

}  // namespace

const char* overlap_mode_name(OverlapMode mode) {
  return name_of(mode, kOverlapSpellings);
}

const char* dispatch_precision_name(DispatchPrecision precision) {
  return name_of(precision, kDispatchSpellings);
}

const char* combine_reduction_name(CombineReduction reduction) {
  return name_of(reduction, kCombineSpellings);
}

const char* gemm_engine_name(GemmEngine engine) {
  return name_of(engine, kGemmSpellings);
}

const char* expert_precision_name(ExpertPrecision precision) {
  return name_of(precision, kExpertSpellings);
}

namespace {

// TuningKey's spellings, in its order.
constexpr const char* kKeyNames[] = {"sms",     "token_tile", "tile_m",      "tile_n",  "tile_k",
                                     "stages",  "cluster",    "skip_rounds", "overlap", "dispatch",
                                     "combine", "gemm",       "experts"};
static_assert(sizeof(kKeyNames) / sizeof(kKeyNames[0]) == static_cast<size_t>(TuningKey::kCount),
              "one name per TuningKey");

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

int parse_int(const std::string& key, const std::string& value) {
  UNIEP_CHECK(!value.empty(), "tuning: key '", key, "' needs an integer value");
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(value.c_str(), &end, 10);
  UNIEP_CHECK(end && *end == '\0' && errno == 0 && v >= std::numeric_limits<int>::min() &&
                  v <= std::numeric_limits<int>::max(),
              "tuning: key '", key, "' expects an integer, got '", value, "'");
  return static_cast<int>(v);
}

bool is_pow2(int v) {
  return v > 0 && (v & (v - 1)) == 0;
}

// tile_m, tile_n, tile_k, stages and cluster: "auto" (stored as 0), or a positive integer;
// validate() checks its range.
int parse_auto_int(const std::string& key, const std::string& value) {
  if (value == "auto") return 0;
  const int v = parse_int(key, value);
  UNIEP_CHECK(v != 0, "tuning: ", key, " must be auto or a positive integer, got 0");
  return v;
}

// An enum key's value from its spellings, or an error naming the key and the listed spellings
// ("a, b or c").
template <class E, size_t N>
E parse_choice(const std::string& key, const std::string& value,
               const Spelling<E> (&spellings)[N]) {
  for (const auto& s : spellings)
    if (value == s.text) return s.value;
  size_t left = 0;
  for (const auto& s : spellings) left += s.listed ? 1 : 0;
  std::string listed;
  for (const auto& s : spellings) {
    if (!s.listed) continue;
    listed += s.text;
    --left;
    listed += left > 1 ? ", " : left == 1 ? " or " : "";
  }
  throw Error(StatusCode::kInvalidArgument,
              detail::str_cat("tuning: ", key, " must be ", listed, ", got '", value, "'"));
}

std::string auto_int(int v) {
  return v == 0 ? std::string("auto") : std::to_string(v);
}

}  // namespace

const char* tuning_key_name(TuningKey key) {
  const int k = static_cast<int>(key);
  return k >= 0 && k < static_cast<int>(TuningKey::kCount) ? kKeyNames[k] : "?";
}

TuningKey tuning_key(const std::string& name) {
  for (int k = 0; k < static_cast<int>(TuningKey::kCount); ++k)
    if (name == kKeyNames[k]) return static_cast<TuningKey>(k);
  std::string keys;
  for (const char* k : kKeyNames) keys += detail::str_cat(keys.empty() ? "" : ", ", k);
  throw Error(StatusCode::kInvalidArgument,
              detail::str_cat("tuning: unknown key '", name, "' (expected one of: ", keys, ")"));
}

OverlapMode parse_overlap_mode(const std::string& value) {
  return parse_choice("overlap", value, kOverlapSpellings);
}

DispatchPrecision parse_dispatch_precision(const std::string& value) {
  return parse_choice("dispatch", value, kDispatchSpellings);
}

CombineReduction parse_combine_reduction(const std::string& value) {
  return parse_choice("combine", value, kCombineSpellings);
}

GemmEngine parse_gemm_engine(const std::string& value) {
  return parse_choice("gemm", value, kGemmSpellings);
}

ExpertPrecision parse_expert_precision(const std::string& value) {
  return parse_choice("experts", value, kExpertSpellings);
}

std::string TuningParams::to_string(bool given_only) const {
  const std::string values[] = {detail::str_cat(comm_sms, "/", total_sms),
                                std::to_string(token_tile),
                                auto_int(tile_m),
                                auto_int(tile_n),
                                auto_int(tile_k),
                                auto_int(stages),
                                auto_int(cluster),
                                skip_rounds < 0 ? std::string("auto") : std::to_string(skip_rounds),
                                overlap_mode_name(overlap),
                                dispatch_precision_name(dispatch),
                                combine_reduction_name(combine),
                                gemm_engine_name(gemm),
                                expert_precision_name(experts)};
  static_assert(sizeof(values) / sizeof(values[0]) == static_cast<size_t>(TuningKey::kCount),
                "one value per TuningKey");
  std::string out;
  for (int k = 0; k < static_cast<int>(TuningKey::kCount); ++k) {
    if (given_only && !given(static_cast<TuningKey>(k))) continue;
    out += detail::str_cat(out.empty() ? "" : ",", kKeyNames[k], "=", values[k]);
  }
  return out;
}

TuningParams TuningParams::parse(const std::string& text) {
  // A C string ends at the first NUL, so the value checks below (strtol) would stop there and
  // accept whatever follows it: reject NUL outright.
  const size_t nul = text.find('\0');
  UNIEP_CHECK(nul == std::string::npos, "tuning: NUL character at position ", nul,
              " of the tuning string (", text.size(), " characters); it must be plain text");
  TuningParams p;
  size_t pos = 0;
  const std::string body = trim(text);
  // The loop below stops after the last comma, so a trailing one would pass unseen; a leading or
  // doubled one is an empty entry inside it.
  UNIEP_CHECK(body.empty() || body.back() != ',', "tuning: empty entry at the end of '", text, "'");
  while (pos < body.size()) {
    size_t comma = body.find(',', pos);
    if (comma == std::string::npos) comma = body.size();
    const std::string item = trim(body.substr(pos, comma - pos));
    pos = comma + 1;
    UNIEP_CHECK(!item.empty(), "tuning: empty entry in '", text, "'");
    const size_t eq = item.find('=');
    UNIEP_CHECK(eq != std::string::npos, "tuning: entry '", item, "' must be key=value");
    const std::string key = trim(item.substr(0, eq));
    const std::string value = trim(item.substr(eq + 1));
    const TuningKey which = tuning_key(key);
    UNIEP_CHECK(!p.given(which), "tuning: key '", key, "' given twice");
    p.set_given(which);
    switch (which) {
      case TuningKey::kSms: {
        const size_t slash = value.find('/');
        if (slash == std::string::npos) {
          p.comm_sms = parse_int(key, value);
        } else {
          // Spaces around '/' as around '=' and ','.
          p.comm_sms = parse_int(key, trim(value.substr(0, slash)));
          p.total_sms = parse_int(key, trim(value.substr(slash + 1)));
        }
        break;
      }
      case TuningKey::kTokenTile:
        p.token_tile = parse_int(key, value);
        break;
      case TuningKey::kTileM:
        p.tile_m = parse_auto_int(key, value);
        break;
      case TuningKey::kTileN:
        p.tile_n = parse_auto_int(key, value);
        break;
      case TuningKey::kTileK:
        p.tile_k = parse_auto_int(key, value);
        break;
      case TuningKey::kStages:
        p.stages = parse_auto_int(key, value);
        break;
      case TuningKey::kCluster:
        p.cluster = parse_auto_int(key, value);
        break;
      case TuningKey::kSkipRounds:
        if (value == "auto") {
          p.skip_rounds = -1;
        } else {
          p.skip_rounds = parse_int(key, value);
          UNIEP_CHECK(p.skip_rounds >= 0,
                      "tuning: skip_rounds must be auto or an integer >= 0, got '", value, "'");
        }
        break;
      case TuningKey::kOverlap:
        p.overlap = parse_overlap_mode(value);
        break;
      case TuningKey::kDispatch:
        p.dispatch = parse_dispatch_precision(value);
        break;
      case TuningKey::kCombine:
        p.combine = parse_combine_reduction(value);
        break;
      case TuningKey::kGemm:
        p.gemm = parse_gemm_engine(value);
        break;
      case TuningKey::kExperts:
        p.experts = parse_expert_precision(value);
        break;
      case TuningKey::kCount:
        break;  // tuning_key never returns it
    }
  }
  p.validate();
  return p;
}

void TuningParams::validate() const {
  UNIEP_CHECK(comm_sms >= 1 && comm_sms <= 1024,
              "tuning: sms (communication SMs) must be in [1, 1024], got ", comm_sms);
  // total == comm: a call that only communicates (a dispatch, a combine) kept to those SMs.
  UNIEP_CHECK(total_sms == 0 || total_sms >= comm_sms, "tuning: sms total (", total_sms,
              ") must be 0 (whole device) or at least the communication SMs (", comm_sms, ")");
  UNIEP_CHECK(token_tile >= 1 && token_tile <= 4096,
              "tuning: token_tile must be in [1, 4096], got ", token_tile);
  auto tile_ok = [](int v) { return v == 0 || (is_pow2(v) && v >= 16 && v <= 256); };
  UNIEP_CHECK(tile_ok(tile_m), "tuning: tile_m must be auto or a power of two in [16, 256], got ",
              tile_m);
  UNIEP_CHECK(tile_ok(tile_n), "tuning: tile_n must be auto or a power of two in [16, 256], got ",
              tile_n);
  UNIEP_CHECK(tile_ok(tile_k), "tuning: tile_k must be auto or a power of two in [16, 256], got ",
              tile_k);
  UNIEP_CHECK(stages >= 0 && stages <= 8, "tuning: stages must be auto or in [1, 8], got ", stages);
  UNIEP_CHECK(cluster >= 0 && cluster <= 2,
              "tuning: cluster (CTAs along M of a thread-block cluster) must be auto, 1 or 2, got ",
              cluster);
  UNIEP_CHECK(skip_rounds >= -1 && skip_rounds <= (1 << 20),
              "tuning: skip_rounds must be auto (-1) or in [0, 2^20], got ", skip_rounds);
  UNIEP_CHECK(experts != ExpertPrecision::kFp8 || dispatch == DispatchPrecision::kFp8E4M3,
              "tuning: experts=fp8 needs dispatch=fp8 (the fp8 GEMMs read the rows in the fp8 "
              "dispatch's format), got dispatch=",
              dispatch_precision_name(dispatch));
}

void check_expert_precision(const TuningParams& tuning, int64_t hidden, int64_t ffn) {
  if (!tuning.fp8_experts()) return;
  constexpr int64_t kBlock = 128;
  UNIEP_CHECK(hidden % kBlock == 0 && ffn % kBlock == 0, "tuning dispatch=fp8",
              tuning.experts == ExpertPrecision::kFp8 ? ",experts=fp8" : "",
              " runs the experts in fp8 with one weight scale per 128 x 128 block: hidden "
              "(x.size(1)) and the expert FFN size (w2.size(1)) must be multiples of 128, got "
              "hidden=",
              hidden, ", ffn=", ffn, "; add experts=bf16 for bf16 expert GEMMs on the fp8 rows");
}

bool TuningParams::operator==(const TuningParams& o) const {
  return comm_sms == o.comm_sms && total_sms == o.total_sms && token_tile == o.token_tile &&
         tile_m == o.tile_m && tile_n == o.tile_n && tile_k == o.tile_k && stages == o.stages &&
         cluster == o.cluster && skip_rounds == o.skip_rounds && overlap == o.overlap &&
         dispatch == o.dispatch && combine == o.combine && gemm == o.gemm && experts == o.experts;
}

int grouped_gemm_auto_config(int64_t rows, int64_t num_experts, int64_t n, int64_t k, bool swiglu,
                             int64_t pingpong_rows) {
  // The bounds keep the products below (rows per expert times experts) within int64.
  UNIEP_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts must be in [1, ",
              kMaxExperts, "], got ", num_experts);
  UNIEP_CHECK(rows >= 0, "rows must be >= 0, got ", rows);
  UNIEP_CHECK(n >= 0 && k >= 0, "n and k must be >= 0, got n=", n, ", k=", k);
  UNIEP_CHECK(pingpong_rows >= 1 && pingpong_rows <= (int64_t{1} << 32),
              "pingpong_rows must be in [1, 2**32], got ", pingpong_rows);
  // Experts of about 128 rows or fewer leave a 128-row tile's second warpgroup half idle and give
  // the mainloop little to hide the epilogue under: the 64-row ping-pong tiles serve them better
  // (64 x 256 where N allows: 19% faster than 64 x 128 on 256 experts of ~128 rows; one H100,
  // 2026-11-25, the tree of commit cf3d04d). Further up the ping-pong tiles still win where the
  // epilogue is heavy or the mainloop short, with the SwiGLU epilogue and when k <= n, as long as
  // the memory keeps up with their extra weight loads: on one H200 up to 2048 rows (with the
  // down projection, 8-12% less time than the cooperative tiles on experts of 256 to 8192 rows;
  // the down projection alone 7-11% on 512 and 1024 rows; 2026-11-26, commit d0137b0), on one
  // H100 up to 256 (20-30% more time at 512 and 1024 rows; 2026-11-26, commit 59fa2a5):
  // pingpong_rows. Above that, and for the up projection's long k, the 128 x 256 cooperative
  // tiles, which load the fewest bytes per FLOP.
  const bool small = rows <= 128 * num_experts || n <= 128;
  const bool pingpong_wins = rows <= pingpong_rows * num_experts && (swiglu || k <= n);
  if (!(small || pingpong_wins)) return 0;
  return n >= 256 ? 4 : 1;
}

int grouped_gemm_auto_cluster(int64_t rows, int64_t num_experts) {
  UNIEP_CHECK(num_experts >= 1, "num_experts must be >= 1, got ", num_experts);
  UNIEP_CHECK(rows >= 0, "rows must be >= 0, got ", rows);
  // The 64 x 256 ping-pong tiles in clusters of one against two, CUTLASS's grouped kernels on the
  // same operands with the same bits (bench/grouped_variants, one H200, 2026-12-04): 0.82-0.90x
  // the time on experts of 128 and 256 rows (Qwen3-like and DeepSeek-V3's 256 experts), but
  // 1.03-1.08x on DeepSeek-V3's EP8 rank (1024 rows) and 1.11-1.15x on Mixtral's EP4 rank (8192).
  return rows <= 256 * num_experts ? 1 : 2;
}

int fused_auto_tile_n(int tile_m, int64_t capacity, int64_t num_experts, int64_t ffn,
                      int sm_count) {
  UNIEP_CHECK(tile_m >= 0 && capacity >= 0 && num_experts >= 0 && ffn >= 0 && sm_count >= 0,
              "fused_auto_tile_n: tile_m, capacity, num_experts, ffn and sm_count must be >= 0, "
              "got ",
              tile_m, ", ", capacity, ", ", num_experts, ", ", ffn, ", ", sm_count);
  if (tile_m != 64 || num_experts == 0 || capacity > 64 * num_experts) return 256;
  // One token of top-8 (8 experts touched): on 256 experts of FFN 2048, GEMM 1's 256 tiles of
  // 64 x 128 took two rounds of 132 SMs where 128 tiles of 64 x 256 took one, and the step took
  // 1.07x (H200, b03d94d) and 1.17x (H100, 4967396) the 64 x 256 tiles' time (CUDA graphs,
  // bench_decode); on 128 experts of FFN 768 (96 tiles of 64 x 128: one round) the 128-wide
  // tiles were 0.97x and 1.00x, and from 16 tokens up, where both widths take many rounds,
  // 0.90-0.96x on the H200.
  if (ffn > 0 && sm_count > 0) {
    const int64_t touched = std::min(capacity, num_experts);
    const int64_t narrow = touched * ((2 * ffn + 127) / 128);
    const int64_t wide = touched * ((2 * ffn + 255) / 256);
    if (narrow > sm_count && wide <= sm_count) return 256;
  }
  return 128;
}

int grouped_gemm_fp8_auto_config(int64_t rows, int64_t num_experts) {
  UNIEP_CHECK(num_experts >= 1 && num_experts <= kMaxExperts, "num_experts must be in [1, ",
              kMaxExperts, "], got ", num_experts);
  UNIEP_CHECK(rows >= 0, "rows must be >= 0, got ", rows);
  // Experts of a few rows each (decode) are a stream of weight tiles: the ping-pong 64-row tiles,
  // one warpgroup's scale promotion and epilogue under the other's mainloop, keep more of them in
  // flight. The CUDA graph of the whole fp8 decode step took 0.86-0.93x the time with them on
  // 1-512 tokens over 128 experts of FFN 768 and 256 of FFN 2048 (one H200, 2026-12-03, commit
  // 137c36f; the same bits). Each GEMM alone, by rows per expert on average (the same loads'
  // up and down projections, uniform routing; one H200, 2026-12-03, a6b47a5): 0.77-0.97x the
  // cooperative tile's time from 1 to 32 rows, 0.95-1.32x at 64 (where routing puts more than
  // 64 rows on many experts, so they take two 64-row tiles), 1.05-1.48x from 128. So the
  // cooperative 128-row tiles, which load each weight tile for twice the rows, above 32.
  constexpr int64_t kPingPongRowsPerExpert = 32;
  return rows <= kPingPongRowsPerExpert * num_experts ? 1 : 0;
}

}  // namespace uniep
