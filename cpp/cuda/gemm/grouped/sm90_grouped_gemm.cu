// include/uniep/cuda/grouped_gemm.hpp's entry points: argument checks, the choice of a
// configuration (grouped_configs.hpp), the workspace, the problem kernel (grouped_problems.cuh)
// and the launch of the chosen CUTLASS kernel (its own translation unit, grouped_run.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>

#include "cuda/gemm/gemm.hpp"
#include "cuda/gemm/grouped/grouped_configs.hpp"
#include "cuda/gemm/grouped/grouped_problems.cuh"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/tuning.hpp"

namespace uniep::cuda {
namespace {

constexpr int64_t kAlign = grouped::kAlign;
constexpr int64_t kMaxExtent = std::numeric_limits<int>::max();

bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// In preference order: grouped_gemm_select takes the first match of a partial request. The first
// five are the tiles grouped_gemm_auto_config indexes; a tile also compiled in another cluster
// comes after them.
const std::array<const grouped::GroupedEntry*, 6>& entries() {
  static const std::array<const grouped::GroupedEntry*, 6> all = {
      &grouped::entry_coop_128x256x64(),    &grouped::entry_pingpong_64x128x128(),
      &grouped::entry_coop_128x128x64(),    &grouped::entry_coop_256x128x64(),
      &grouped::entry_pingpong_64x256x64(), &grouped::entry_pingpong_64x256x64_c1(),
  };
  return all;
}

// The backward kinds' configurations. kDgrad: [0] for large experts, [1] for small ones, [2] the
// same tile in clusters of one (dgrad_entry). kWgrad: [0] by default, [1] for narrow outputs, [2]
// for experts of many rows (wgrad_entry).
const std::array<const grouped::GroupedEntry*, 3>& dgrad_entries() {
  static const std::array<const grouped::GroupedEntry*, 3> all = {
      &grouped::entry_dgrad_coop_128x256x64(), &grouped::entry_dgrad_pingpong_64x256x64(),
      &grouped::entry_dgrad_pingpong_64x256x64_c1()};
  return all;
}
const std::array<const grouped::GroupedEntry*, 3>& wgrad_entries() {
  static const std::array<const grouped::GroupedEntry*, 3> all = {
      &grouped::entry_wgrad_coop_128x256x64(), &grouped::entry_wgrad_coop_128x128x64(),
      &grouped::entry_wgrad_pingpong_64x256x64()};
  return all;
}

bool swiglu_epilogue(const GroupedGemmProblem& p) {
  return p.epilogue == GroupedGemmEpilogue::kSwiGlu ||
         p.epilogue == GroupedGemmEpilogue::kSwiGluPlain;
}

// The rows the shape rules price: the expected count where the caller gave one.
int64_t rule_rows(const GroupedGemmProblem& p) {
  return p.shape_rows > 0 ? std::min(p.shape_rows, p.rows) : p.rows;
}

// The data gradient's rows are the forward's: for small experts the 64-row tile, in the cluster
// asked for (cluster_m; any other request is the forward's) or else the one the forward's rule
// gives those rows (clusters of one up to 256 rows an expert). On DeepSeek-V3's 256 experts
// (~128 rows) moe_backward took 0.955x the time with clusters of one as with two (one H200,
// 2026-12-04, bench_experts --part layers, interleaved).
const grouped::GroupedEntry* dgrad_entry(const GroupedGemmProblem& p, int cluster_m) {
  if (rule_rows(p) > 128 * p.num_experts) return dgrad_entries()[0];
  const int cluster =
      cluster_m != 0 ? cluster_m : grouped_gemm_auto_cluster(rule_rows(p), p.num_experts);
  return dgrad_entries()[cluster == 1 ? 2 : 1];
}

// The weight gradient's K is each expert's rows. With experts of 512 rows or more the ping-pong
// tiles (one warpgroup's epilogue under the other's mainloop) won: 8-9% on DeepSeek-V3's EP8
// rank (1024 rows), 2-3% on Mixtral's EP4 rank (8192); on the Qwen3-like load's 256 rows they
// lost 2-4% (one H200, 2026-11-27, both tiles timed interleaved in the experiment behind
// commit 5b4b75a).
const grouped::GroupedEntry* wgrad_entry(const GroupedGemmProblem& p) {
  if (p.n <= 128) return wgrad_entries()[1];
  return wgrad_entries()[rule_rows(p) >= 512 * p.num_experts ? 2 : 0];
}

// The problem kernel writes each stride's one dynamic value into an 8-byte slot that the grouped
// kernel reads as its CuTe stride type: that needs the value at offset 0 and nothing else there.
bool strides_are_one_int64() {
  auto one = [](auto stride, int64_t v) {
    int64_t out = 0;
    std::memcpy(&out, &stride, sizeof(out));
    return sizeof(stride) == sizeof(int64_t) && out == v;
  };
  return one(grouped::KMajorA{7, cute::_1{}, cute::_0{}}, 7) &&
         one(grouped::MMajorA{cute::_1{}, 7, cute::_0{}}, 7) &&
         one(grouped::NMajorB{cute::_1{}, 7, cute::_0{}}, 7) &&
         one(grouped::KMajorB{7, cute::_1{}, cute::_0{}}, 7);
}

std::string describe(const GroupedGemmConfig& c) {
  return detail::str_cat("tile_m=", c.tile_m, ",tile_n=", c.tile_n, ",tile_k=", c.tile_k,
                         ",stages=", c.stages, ",cluster=", c.cluster_m, " (",
                         c.pingpong ? "ping-pong" : "cooperative", ", cluster ", c.cluster_m, "x",
                         c.cluster_n, ")");
}

bool matches(const GroupedGemmConfig& c, const GroupedGemmTiles& t) {
  return (t.tile_m == 0 || t.tile_m == c.tile_m) && (t.tile_n == 0 || t.tile_n == c.tile_n) &&
         (t.tile_k == 0 || t.tile_k == c.tile_k) && (t.stages == 0 || t.stages == c.stages) &&
         (t.cluster_m == 0 || t.cluster_m == c.cluster_m);
}

// The configuration of entry `index`'s tile, depth and schedule in clusters of cluster_m CTAs
// along M, or -1 where that tile was not compiled so.
int with_cluster(int index, int cluster_m) {
  const auto& all = entries();
  const GroupedGemmConfig& c = all[index]->config;
  for (size_t i = 0; i < all.size(); ++i) {
    const GroupedGemmConfig& o = all[i]->config;
    if (o.tile_m == c.tile_m && o.tile_n == c.tile_n && o.tile_k == c.tile_k &&
        o.stages == c.stages && o.pingpong == c.pingpong && o.cluster_m == cluster_m)
      return static_cast<int>(i);
  }
  return -1;
}

// A choice whose tile has another cluster compiled: the one of the automatic rule.
int auto_cluster(int index, const GroupedGemmProblem& p) {
  if (p.num_experts < 1 || p.rows < 0) return index;  // grouped_gemm_supports names these
  const int other = with_cluster(index, grouped_gemm_auto_cluster(rule_rows(p), p.num_experts));
  return other >= 0 ? other : index;
}

std::string valid_configs() {
  std::string valid;
  for (const auto* e : entries()) valid += detail::str_cat("\n  ", describe(e->config));
  return valid;
}

}  // namespace

bool grouped_gemm_device_ok(int device) {
  return gemm_sm90_device_ok(device);  // the same sm_90a-only build as the dense GEMM
}

Status grouped_gemm_supports(const GroupedGemmProblem& p) {
  auto bad = [](auto&&... what) {
    return Status{StatusCode::kInvalidArgument, detail::str_cat(what...)};
  };
  auto unsupported = [](auto&&... what) {
    return Status{StatusCode::kUnsupported, detail::str_cat(what...)};
  };
  if (p.num_experts < 1 || p.num_experts > kMaxExtent)
    return bad("num_experts must be in [1, 2^31), got ", p.num_experts);
  if (p.rows < 0 || p.rows > kMaxExtent) return bad("rows must be in [0, 2^31), got ", p.rows);
  if (p.k < 1 || p.k > kMaxExtent) return bad("k must be in [1, 2^31), got ", p.k);
  if (p.n < 1 || p.n > kMaxExtent) return bad("n must be in [1, 2^31), got ", p.n);
  if (p.k % kAlign != 0)
    return unsupported("k must be a multiple of ", kAlign,
                       " (the grouped GEMM's TMA moves 16-byte rows), got ", p.k);
  if (p.n % kAlign != 0)
    return unsupported("n must be a multiple of ", kAlign,
                       " (the grouped GEMM's TMA moves 16-byte rows), got ", p.n);
  if (p.epilogue == GroupedGemmEpilogue::kSwiGlu && p.n % 16 != 0)
    return unsupported(
        "n (2 x the FFN size) must be a multiple of 16 for the SwiGLU epilogue "
        "(gate and up interleave in blocks of 8), got ",
        p.n);
  if (p.epilogue == GroupedGemmEpilogue::kSwiGluPlain && p.n % 128 != 0)
    return unsupported(
        "n (2 x the FFN size) must be a multiple of 128 for the SwiGLU epilogue on w1 as stored "
        "(its loads read gate and up in blocks of 64 columns), got ",
        p.n);
  if (p.epilogue != GroupedGemmEpilogue::kStore && p.epilogue != GroupedGemmEpilogue::kSwiGlu &&
      p.epilogue != GroupedGemmEpilogue::kSwiGluPlain &&
      p.epilogue != GroupedGemmEpilogue::kStoreF32)
    return bad("epilogue must be kStore, kSwiGlu, kSwiGluPlain or kStoreF32");
  if (p.kind != GroupedGemmKind::kForward && p.kind != GroupedGemmKind::kDgrad &&
      p.kind != GroupedGemmKind::kWgrad)
    return bad("kind must be kForward, kDgrad or kWgrad");
  if (p.epilogue != GroupedGemmEpilogue::kStore && p.kind != GroupedGemmKind::kForward)
    return bad(p.epilogue == GroupedGemmEpilogue::kStoreF32 ? "the fp32 store epilogue"
                                                            : "the SwiGLU epilogue",
               " applies to the forward (kind kForward) only");
  if (p.offs == nullptr) return bad("offs must not be null");
  const bool wgrad = p.kind == GroupedGemmKind::kWgrad;
  if ((!wgrad || p.rows > 0) && (p.w == nullptr || !aligned(p.w)))
    return unsupported("w must be 16-byte aligned (non-null)");
  if (p.rows > 0 && (p.x == nullptr || !aligned(p.x)))
    return unsupported("x must be 16-byte aligned (non-null)");
  if ((wgrad || p.rows > 0) && (p.out == nullptr || !aligned(p.out)))
    return unsupported("out must be 16-byte aligned (non-null)");
  return Status::Ok();
}

const GroupedGemmConfig* grouped_gemm_configs(int* count) {
  static const std::array<GroupedGemmConfig, 6> configs = [] {
    std::array<GroupedGemmConfig, 6> c;
    for (size_t i = 0; i < c.size(); ++i) c[i] = entries()[i]->config;
    return c;
  }();
  if (count != nullptr) *count = static_cast<int>(configs.size());
  return configs.data();
}

int64_t grouped_gemm_pingpong_rows(int device) {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return 2048;
  // Peak bandwidth = 2 (double data rate) x memory clock x bus width; read once per device.
  static std::mutex mutex;
  static std::map<int, int64_t> rows;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = rows.find(device);
  if (it != rows.end()) return it->second;
  int clock_khz = 0, bus_bits = 0;
  const bool known =
      cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, device) == cudaSuccess &&
      clock_khz > 0 && bus_bits > 0;
  if (!known) cudaGetLastError();  // leave no sticky error behind for the caller
  const double bytes_per_s = 2.0 * clock_khz * 1e3 * bus_bits / 8.0;
  return rows[device] = !known || bytes_per_s >= 4e12 ? 2048 : 256;
}

Status grouped_gemm_select(const GroupedGemmProblem& p, const GroupedGemmTiles& want, int* index,
                           int device) {
  const auto& all = entries();
  const bool plain = p.epilogue == GroupedGemmEpilogue::kSwiGluPlain;
  // PlainGateUpMainloop's tiles hold whole (gate, up) pairs of 64-column blocks, tile_n / 128 of
  // them: tile_n / 2 must divide the FFN size n / 2.
  auto plain_fits = [&p](const GroupedGemmConfig& c) { return (p.n / 2) % (c.tile_n / 2) == 0; };
  if (want.tile_m == 0 && want.tile_n == 0 && want.tile_k == 0 && want.stages == 0) {
    // The shape's rule lives with the tuning space (uniep/tuning.hpp), where the tuner's cost
    // model reads it too.
    try {
      *index = grouped_gemm_auto_config(rule_rows(p), p.num_experts, p.n, p.k, swiglu_epilogue(p),
                                        grouped_gemm_pingpong_rows(device));
    } catch (const Error& e) {
      return {e.code(), e.what()};
    }
    if (plain && !plain_fits(all[*index]->config)) {
      // The first configuration of the same height whose tile fits (a 128-wide one: I is a
      // multiple of 64).
      const int tile_m = all[*index]->config.tile_m;
      int fit = -1;
      for (size_t i = 0; i < all.size() && fit < 0; ++i)
        if (all[i]->config.tile_m == tile_m && plain_fits(all[i]->config))
          fit = static_cast<int>(i);
      if (fit < 0)
        return {
            StatusCode::kInternal,
            detail::str_cat("no compiled configuration of tile_m=", tile_m,
                            " fits the SwiGLU epilogue on w1 as stored with FFN size ", p.n / 2)};
      *index = fit;
    }
    if (want.cluster_m == 0) {
      *index = auto_cluster(*index, p);
      return Status::Ok();
    }
    const int asked = with_cluster(*index, want.cluster_m);
    if (asked < 0)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("cluster=", want.cluster_m, ": the automatic choice for this shape, ",
                              describe(all[*index]->config),
                              ", was not compiled in that cluster; give the tile too (the compiled "
                              "configurations are:",
                              valid_configs(), ")")};
    *index = asked;
    return Status::Ok();
  }
  // The first match; with kSwiGluPlain the first whose tile_n fits the FFN size.
  const GroupedGemmConfig* unfit = nullptr;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!matches(all[i]->config, want)) continue;
    if (plain && !plain_fits(all[i]->config)) {
      if (unfit == nullptr) unfit = &all[i]->config;
      continue;
    }
    *index = want.cluster_m == 0 ? auto_cluster(static_cast<int>(i), p) : static_cast<int>(i);
    return Status::Ok();
  }
  if (unfit != nullptr)
    return {StatusCode::kUnsupported,
            detail::str_cat("the SwiGLU epilogue on w1 as stored needs the FFN size (n / 2 = ",
                            p.n / 2, ") to be a multiple of tile_n / 2; configuration ",
                            describe(*unfit), " has tile_n=", unfit->tile_n,
                            " (tile_n=128 takes FFN sizes that are multiples of 64)")};
  return {StatusCode::kInvalidArgument,
          detail::str_cat("no grouped GEMM configuration has tile_m=", want.tile_m,
                          ",tile_n=", want.tile_n, ",tile_k=", want.tile_k, ",stages=", want.stages,
                          ",cluster=", want.cluster_m,
                          " (0: any); the compiled ones are:", valid_configs())};
}

size_t grouped_gemm_workspace_bytes(int64_t num_experts, int sm_count) {
  if (num_experts < 1 || num_experts > kMaxExtent || sm_count < 1) return 0;
  size_t gemm = 0;
  for (const auto* e : dgrad_entries())
    gemm = std::max(gemm, e->gemm_workspace_bytes(num_experts, sm_count));
  for (const auto* e : wgrad_entries())
    gemm = std::max(gemm, e->gemm_workspace_bytes(num_experts, sm_count));
  for (const auto* e : entries())
    gemm = std::max(gemm, e->gemm_workspace_bytes(num_experts, sm_count));
  return grouped::group_arrays_bytes(num_experts) + gemm;
}

Status grouped_gemm_bf16(const GroupedGemmProblem& p, const GroupedGemmTiles& tiles, int device,
                         int sm_count, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
  if (Status s = grouped_gemm_supports(p); !s.ok()) return s;
  static const bool strides_ok = strides_are_one_int64();
  if (!strides_ok)
    return {StatusCode::kInternal,
            "the grouped GEMM's stride slots do not match CuTe's stride layout in this build"};
  const grouped::GroupedEntry* entry = nullptr;
  if (p.kind == GroupedGemmKind::kForward) {
    int index = 0;
    if (Status s = grouped_gemm_select(p, tiles, &index, device); !s.ok()) return s;
    entry = entries()[index];
  } else if (p.kind == GroupedGemmKind::kDgrad) {
    entry = dgrad_entry(p, tiles.cluster_m);
  } else {
    entry = wgrad_entry(p);
  }
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  if (p.rows == 0 && p.kind != GroupedGemmKind::kWgrad) return Status::Ok();
  const size_t need = grouped_gemm_workspace_bytes(p.num_experts, sm_count);
  if (Status s = grouped::check_workspace(workspace, workspace_bytes, need, "the grouped GEMM");
      !s.ok())
    return s;

  const grouped::Workspace ws = grouped::carve(workspace, p.num_experts);
  const bool swiglu = swiglu_epilogue(p);
  const bool f32 = p.epilogue == GroupedGemmEpilogue::kStoreF32;
  const int64_t out_n = swiglu ? p.n / 2 : p.n;
  const int rows = static_cast<int>(p.rows), k = static_cast<int>(p.k), n = static_cast<int>(p.n);
  const auto* x = static_cast<const grouped::Bf16*>(p.x);
  const auto* w = static_cast<const grouped::Bf16*>(p.w);
  auto* out = static_cast<grouped::Bf16*>(p.out);
  const int experts = static_cast<int>(p.num_experts);
  switch (p.kind) {
    case GroupedGemmKind::kForward:
      if (f32)
        grouped::build_grouped_problems<grouped::GroupedKind::kForward><<<1, 32, 0, stream>>>(
            p.offs, experts, rows, k, n, n, x, w, static_cast<float*>(p.out), ws);
      else
        grouped::build_grouped_problems<grouped::GroupedKind::kForward><<<1, 32, 0, stream>>>(
            p.offs, experts, rows, k, n, static_cast<int>(out_n), x, w, out, ws);
      break;
    case GroupedGemmKind::kDgrad:
      grouped::build_grouped_problems<grouped::GroupedKind::kDgrad>
          <<<1, 32, 0, stream>>>(p.offs, experts, rows, k, n, n, x, w, out, ws);
      break;
    case GroupedGemmKind::kWgrad:
      grouped::build_grouped_problems<grouped::GroupedKind::kWgrad>
          <<<1, 32, 0, stream>>>(p.offs, experts, rows, k, n, n, x, w, out, ws);
      // A sum over no rows is zero: the experts the GEMM gives no tiles.
      grouped::zero_empty_wgrad<<<dim3(static_cast<unsigned>(experts), 8), 256, 0, stream>>>(
          ws.shapes, p.k * p.n, out);
      break;
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the grouped GEMM's problem kernel failed to launch: ",
                            cudaGetErrorString(e))};

  if (p.epilogue == GroupedGemmEpilogue::kSwiGluPlain)
    return entry->run_swiglu_plain(ws, p.num_experts, out_n, device, sm_count, stream,
                                   grouped::PlainW1{w, p.k, p.n});
  if (f32) return entry->run_f32(ws, p.num_experts, out_n, device, sm_count, stream);
  return (swiglu ? entry->run_swiglu : entry->run)(ws, p.num_experts, out_n, device, sm_count,
                                                   stream);
}

}  // namespace uniep::cuda
