// The fp8 grouped GEMM's entry points (include/uniep/cuda/grouped_gemm.hpp, grouped_gemm_fp8):
// e4m3 rows with a scale per 1 x 128 block (the format the fp8 dispatch sends) times e4m3 expert
// weights with a scale per 128 x 128 block, fp32 accumulation, bf16 out; argument checks, the
// choice among the compiled tiles (fp8_kernel.cuh), the problem kernels and the launch.
//
// Hopper's fp8 WGMMA reads both operands K-major: the weights are stored [E, n, k] (the transpose
// of the bf16 [E, k, n]), and the kernel reads A's scales M-major, so the problem kernel reorders
// the rows' scales expert by expert first. Bits: one k-block order, no split-K, whatever the grid
// or the tile.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>

#include "cuda/gemm/grouped/expert_problem.cuh"
#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/fp8_kernel.cuh"
#include "uniep/tuning.hpp"

namespace uniep::cuda {
namespace {

using grouped::Bf16;
using grouped_fp8::Arrays;
using grouped_fp8::Fp8;
using grouped_fp8::kBlock;
using grouped_fp8::LayoutSFA;
using grouped_fp8::LayoutSFB;
using grouped_fp8::ScaleConfig;

// In preference order: grouped_gemm_fp8_select takes the first match of a partial request (the
// swapped tiles last, so a request that named the others' fields picks what it picked before).
constexpr size_t kFp8Entries = 4;
const std::array<const grouped_fp8::Entry*, kFp8Entries>& fp8_entries() {
  static const std::array<const grouped_fp8::Entry*, kFp8Entries> all = {
      &grouped_fp8::entry_coop_128x128x128(), &grouped_fp8::entry_pingpong_64x128x128(),
      &grouped_fp8::entry_swap_16x128x128(), &grouped_fp8::entry_swap_32x128x128()};
  return all;
}

size_t fp8_arrays_bytes(int64_t num_experts, int64_t rows, int64_t k) {
  const size_t e = static_cast<size_t>(num_experts);
  return 2 * grouped::round_up(e * sizeof(void*)) + grouped::round_up(e * sizeof(LayoutSFA)) +
         grouped::round_up(e * sizeof(LayoutSFB)) +
         grouped::round_up(static_cast<size_t>(rows) * static_cast<size_t>(k / kBlock) *
                           sizeof(float));
}

Arrays carve_fp8(void* base, int64_t num_experts, int64_t rows, int64_t k) {
  const size_t e = static_cast<size_t>(num_experts);
  char* p = static_cast<char*>(base);
  auto take = [&p](size_t bytes) {
    char* at = p;
    p += grouped::round_up(bytes);
    return at;
  };
  Arrays a;
  a.ptr_sfa = reinterpret_cast<const float**>(take(e * sizeof(void*)));
  a.ptr_sfb = reinterpret_cast<const float**>(take(e * sizeof(void*)));
  a.layout_sfa = reinterpret_cast<LayoutSFA*>(take(e * sizeof(LayoutSFA)));
  a.layout_sfb = reinterpret_cast<LayoutSFB*>(take(e * sizeof(LayoutSFB)));
  a.sfa = reinterpret_cast<float*>(
      take(static_cast<size_t>(rows) * static_cast<size_t>(k / kBlock) * sizeof(float)));
  a.gemm = p;
  return a;
}

constexpr int kProblemThreads = 256;

// The problems and the rows' scales in one launch, grid (expert, slice). Every block finds its
// expert's row range as grouped::expert_rows_step does (each end clamped to [0, rows] and raised
// to the largest earlier end: disjoint, ascending ranges inside [0, rows] whatever offs holds),
// by a max over the earlier ends rather than a walk; block (e, 0) writes e's problem entries, as
// grouped_problems.cuh's kernel for the fp8 operands: the shapes, the K-major x rows and w[e]
// [n, k] (kDgrad's layout of w), the bf16 out rows, and the scales' pointers and layouts (A's
// scales: this expert's block of the reordered sfa); swiglu: out rows of n / 2 and B scales per
// 64 columns (GroupedGemmFp8Problem::swiglu). Then every block reorders its slice of the
// expert's scales from [rows, k / 128] row-major (as the dispatch writes them) to M-major: e's
// block at begin_e * kb holds [kb][rows_e]. The slices let a layer of few large experts still
// fill the GPU (one block per expert took 1.5 ms on two Mixtral experts' 16384 x 112 scales,
// longer than the GEMM's own share); one launch where a problem kernel and a reorder kernel took
// two, each a few microseconds of a decode step. swapped: the problems of out^T = w[e] x^T
// (grouped_fp8::SwapGemm): shape (n, m, k), the weights as A and the rows as B, the same
// strides (every operand K-major, out's rows n apart), and the scales in the swapped roles over
// the same memory.
__global__ void __launch_bounds__(kProblemThreads)
    build_fp8_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int k, int n,
                       const Fp8* x, const Fp8* w, const float* w_scales, void* out, bool swiglu,
                       bool out_f32, bool swapped, const float* __restrict__ x_scales,
                       grouped::Workspace ws, Arrays fa) {
  // Launched while the kernel ahead (the plan, the quantize) may still run: offs and x_scales are
  // read after this. The GEMM behind waits for this kernel's end.
  wait_for_prior_grid();
  allow_next_grid();
  const int e = static_cast<int>(blockIdx.x);
  if (e >= num_experts) return;
  auto end_of = [&](int j) { return min(max(offs[j], 0), rows); };
  int begin = 0;
  for (int j = static_cast<int>(threadIdx.x); j < e; j += kProblemThreads)
    begin = max(begin, end_of(j));
  for (int d = 16; d > 0; d /= 2) begin = max(begin, __shfl_xor_sync(0xffffffffu, begin, d));
  __shared__ int warp_max[kProblemThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = begin;
  __syncthreads();
  begin = 0;
  for (int i = 0; i < kProblemThreads / 32; ++i) begin = max(begin, warp_max[i]);
  const grouped::ExpertRows r{begin, max(begin, end_of(e))};
  const int kb = k / kBlock, m = r.end - r.begin;
  if (blockIdx.y == 0 && threadIdx.x == 0) {
    const int nb = swiglu ? n / grouped_fp8::kHalfBlock : n / kBlock;
    if (out_f32)
      grouped::set_expert_problem<grouped::GroupedKind::kDgrad>(ws, e, e, r, k, n, n, x, w,
                                                                static_cast<float*>(out));
    else
      grouped::set_expert_problem<grouped::GroupedKind::kDgrad>(
          ws, e, e, r, k, n, swiglu ? n / 2 : n, x, w, static_cast<Bf16*>(out));
    const int64_t b = r.begin, ee = e;
    if (swapped) {
      ws.shapes[e] = grouped::Shape{n, m, k};
      const Bf16* rows_of_e = ws.ptr_a[e];
      ws.ptr_a[e] = ws.ptr_b[e];
      ws.ptr_b[e] = rows_of_e;
      fa.ptr_sfa[e] = w_scales + ee * kb * nb;
      fa.ptr_sfb[e] = fa.sfa + b * kb;
      fa.swap_layout_sfa()[e] =
          grouped_fp8::SwapScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(n, m, k, 1));
      fa.swap_layout_sfb()[e] =
          grouped_fp8::SwapScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(n, m, k, 1));
    } else {
      fa.ptr_sfa[e] = fa.sfa + b * kb;
      fa.ptr_sfb[e] = w_scales + ee * kb * nb;
      fa.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
      if (swiglu)
        fa.layout_sfb64()[e] =
            grouped_fp8::ScaleConfig64::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
      else
        fa.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
    }
  }
  const int64_t b = r.begin, stride = static_cast<int64_t>(gridDim.y) * kProblemThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kProblemThreads + threadIdx.x;
       i < static_cast<int64_t>(m) * kb; i += stride) {
    const int64_t row = i % m, c = i / m;
    fa.sfa[b * kb + c * m + row] = x_scales[(b + row) * kb + c];
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

}  // namespace

Status grouped_gemm_fp8_supports(const GroupedGemmFp8Problem& p) {
  auto bad = [](auto&&... what) {
    return Status{StatusCode::kInvalidArgument, detail::str_cat(what...)};
  };
  auto unsupported = [](auto&&... what) {
    return Status{StatusCode::kUnsupported, detail::str_cat(what...)};
  };
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (p.num_experts < 1 || p.num_experts > kMax)
    return bad("num_experts must be in [1, 2^31), got ", p.num_experts);
  if (p.rows < 0 || p.rows > kMax) return bad("rows must be in [0, 2^31), got ", p.rows);
  if (p.k < 1 || p.k > kMax || p.k % kBlock != 0)
    return unsupported("k must be a positive multiple of ", kBlock,
                       " (one scale per 128 columns of x and per 128 x 128 block of w), got ", p.k);
  if (p.n < 1 || p.n > kMax || p.n % kBlock != 0)
    return unsupported("n must be a positive multiple of ", kBlock,
                       " (one weight scale per 128 x 128 block), got ", p.n);
  if (p.offs == nullptr) return bad("offs must not be null");
  if (p.w == nullptr || !aligned16(p.w)) return unsupported("w must be 16-byte aligned (non-null)");
  if (p.w_scales == nullptr) return bad("w_scales must not be null");
  if (p.rows > 0 && (p.x == nullptr || !aligned16(p.x)))
    return unsupported("x must be 16-byte aligned (non-null)");
  if (p.rows > 0 && p.x_scales == nullptr) return bad("x_scales must not be null");
  if (p.rows > 0 && (p.out == nullptr || !aligned16(p.out)))
    return unsupported("out must be 16-byte aligned (non-null)");
  if (p.out_f32 && p.swiglu)
    return bad("out_f32 stores the plain product; the SwiGLU epilogue stores bf16");
  return Status::Ok();
}

const GroupedGemmConfig* grouped_gemm_fp8_configs(int* count) {
  static const std::array<GroupedGemmConfig, kFp8Entries> configs = [] {
    std::array<GroupedGemmConfig, kFp8Entries> c;
    for (size_t i = 0; i < c.size(); ++i) c[i] = fp8_entries()[i]->config;
    return c;
  }();
  if (count != nullptr) *count = static_cast<int>(configs.size());
  return configs.data();
}

Status grouped_gemm_fp8_select(const GroupedGemmFp8Problem& p, const GroupedGemmTiles& want,
                               int* index) {
  const auto& all = fp8_entries();
  if (want.tile_m == 0 && want.tile_n == 0 && want.tile_k == 0 && want.stages == 0 &&
      want.cluster_m == 0) {
    // The shape's rule lives with the tuning space (uniep/tuning.hpp), where the tuner's cost
    // model reads it too.
    try {
      *index = grouped_gemm_fp8_auto_config(p.rows, p.num_experts);
    } catch (const Error& e) {
      return {e.code(), e.what()};
    }
    return Status::Ok();
  }
  // The swapped tiles have no SwiGLU epilogue and no fp32 store.
  const bool plain_bf16 = !p.swiglu && !p.out_f32;
  auto matches = [&want, plain_bf16](const GroupedGemmConfig& c) {
    return (plain_bf16 || !c.swapped) && (want.tile_m == 0 || want.tile_m == c.tile_m) &&
           (want.tile_n == 0 || want.tile_n == c.tile_n) &&
           (want.tile_k == 0 || want.tile_k == c.tile_k) &&
           (want.stages == 0 || want.stages == c.stages) &&
           (want.cluster_m == 0 || want.cluster_m == c.cluster_m);
  };
  for (size_t i = 0; i < all.size(); ++i) {
    if (matches(all[i]->config)) {
      *index = static_cast<int>(i);
      return Status::Ok();
    }
  }
  std::string valid;
  for (const auto* e : all)
    if (plain_bf16 || !e->config.swapped)
      valid += detail::str_cat("\n  tile_m=", e->config.tile_m, ",tile_n=", e->config.tile_n,
                               ",tile_k=", e->config.tile_k, ",stages=", e->config.stages,
                               ",cluster=", e->config.cluster_m, " (",
                               e->config.swapped    ? "cooperative, operands swapped"
                               : e->config.pingpong ? "ping-pong"
                                                    : "cooperative",
                               ")");
  return {StatusCode::kInvalidArgument,
          detail::str_cat("no fp8 grouped GEMM configuration has tile_m=", want.tile_m,
                          ",tile_n=", want.tile_n, ",tile_k=", want.tile_k, ",stages=", want.stages,
                          ",cluster=", want.cluster_m, " (0: any); the compiled ones are:", valid)};
}

size_t grouped_gemm_fp8_workspace_bytes(int64_t num_experts, int64_t rows, int64_t k,
                                        int sm_count) {
  if (num_experts < 1 || rows < 0 || k < kBlock || sm_count < 1) return 0;
  const size_t head = grouped::group_arrays_bytes(num_experts);
  const size_t fp8 = fp8_arrays_bytes(num_experts, rows, k);
  void* base = reinterpret_cast<void*>(grouped::kWorkspaceAlign);
  const grouped::Workspace ws = grouped::carve(base, num_experts);
  const Arrays fa = carve_fp8(base, num_experts, rows, k);
  size_t gemm = 0;
  for (const auto* e : fp8_entries())
    gemm = std::max(gemm, e->gemm_workspace_bytes(ws, fa, num_experts, sm_count));
  return head + fp8 + gemm;
}

Status grouped_gemm_fp8(const GroupedGemmFp8Problem& p, int device, int sm_count, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  return grouped_gemm_fp8(p, GroupedGemmTiles{}, device, sm_count, workspace, workspace_bytes,
                          stream);
}

Status grouped_gemm_fp8(const GroupedGemmFp8Problem& p, const GroupedGemmTiles& tiles, int device,
                        int sm_count, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  if (Status s = grouped_gemm_fp8_supports(p); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  int index = 0;
  if (Status s = grouped_gemm_fp8_select(p, tiles, &index); !s.ok()) return s;
  if (p.rows == 0) return Status::Ok();
  const size_t need = grouped_gemm_fp8_workspace_bytes(p.num_experts, p.rows, p.k, sm_count);
  if (Status s = grouped::check_workspace(workspace, workspace_bytes, need, "the fp8 grouped GEMM");
      !s.ok())
    return s;

  const grouped::Workspace ws = grouped::carve(workspace, p.num_experts);
  void* after = static_cast<char*>(workspace) + grouped::group_arrays_bytes(p.num_experts);
  Arrays fa = carve_fp8(after, p.num_experts, p.rows, p.k);
  const grouped_fp8::Entry& entry = *fp8_entries()[static_cast<size_t>(index)];
  const int experts = static_cast<int>(p.num_experts);
  const dim3 grid(experts, std::max(1, std::min(1024, 8 * sm_count / experts)));
  if (cudaError_t e = launch_after_prior(
          build_fp8_problems, grid, dim3(kProblemThreads), 0, stream, p.offs, experts,
          static_cast<int>(p.rows), static_cast<int>(p.k), static_cast<int>(p.n),
          static_cast<const Fp8*>(p.x), static_cast<const Fp8*>(p.w), p.w_scales, p.out, p.swiglu,
          p.out_f32, entry.config.swapped, p.x_scales, ws, fa);
      e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the fp8 grouped GEMM's problem kernel failed to launch: ",
                            cudaGetErrorString(e))};
  if (p.swiglu) return entry.run_swiglu(ws, fa, p.num_experts, p.n / 2, device, sm_count, stream);
  if (p.out_f32) return entry.run_f32(ws, fa, p.num_experts, device, sm_count, stream);
  return entry.run(ws, fa, p.num_experts, device, sm_count, stream);
}

}  // namespace uniep::cuda
