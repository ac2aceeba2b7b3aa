// The fp8 grouped GEMM (include/uniep/cuda/grouped_gemm.hpp, grouped_gemm_fp8): e4m3 rows with a
// scale per 1 x 128 block (the format the fp8 dispatch sends) times e4m3 expert weights with a
// scale per 128 x 128 block, fp32 accumulation, bf16 out.
//
// CUTLASS's blockwise-scaled ptr-array kernel applies the scales on the fp32 side: each 128-deep
// k-block's WGMMA partial sum is multiplied by its A and B scales and added into the fp32
// accumulator (promoted every k-block, so fp8's 2^-4 relative step never compounds over K).
// Hopper's fp8 WGMMA reads both operands K-major: the weights are stored [E, n, k] (the transpose
// of the bf16 [E, k, n]), and the kernel reads A's scales M-major, so a small kernel reorders the
// rows' scales expert by expert first. Bits: one k-block order, no split-K, whatever the grid.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include <cutlass/cutlass.h>
#include <cutlass/float8.h>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/kernel_hardware_info.h>
#include <cute/tensor.hpp>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "cuda/gemm/grouped/expert_rows.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda {
namespace {

using grouped::Bf16;
using Fp8 = cutlass::float_e4m3_t;
constexpr int kBlock = 128;                  // scale block (k, and n for the weights)
constexpr int kFp8Align = 16 / sizeof(Fp8);  // TMA moves 16-byte rows

struct Fp8Gemm {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlock, kBlock>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor*, grouped::kAlign, Bf16, cutlass::layout::RowMajor*,
      grouped::kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8,
      cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kFp8Align, Fp8,
      cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kFp8Align, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<grouped::ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  static_assert(cute::is_same_v<StrideA, grouped::KMajorA>);
  static_assert(cute::is_same_v<StrideB, grouped::KMajorB>);
};

// The fp8 call's own arrays, after the bf16 kinds' (grouped_workspace.hpp): per group the scale
// pointers and layouts, then the rows' scales reordered M-major per expert.
struct Fp8Arrays {
  const float** ptr_sfa = nullptr;
  const float** ptr_sfb = nullptr;
  Fp8Gemm::LayoutSFA* layout_sfa = nullptr;
  Fp8Gemm::LayoutSFB* layout_sfb = nullptr;
  float* sfa = nullptr;  // [rows * k / 128]
  void* gemm = nullptr;
};

size_t fp8_arrays_bytes(int64_t num_experts, int64_t rows, int64_t k) {
  const size_t e = static_cast<size_t>(num_experts);
  return 2 * grouped::round_up(e * sizeof(void*)) +
         grouped::round_up(e * sizeof(Fp8Gemm::LayoutSFA)) +
         grouped::round_up(e * sizeof(Fp8Gemm::LayoutSFB)) +
         grouped::round_up(static_cast<size_t>(rows) * static_cast<size_t>(k / kBlock) *
                           sizeof(float));
}

Fp8Arrays carve_fp8(void* base, int64_t num_experts, int64_t rows, int64_t k) {
  const size_t e = static_cast<size_t>(num_experts);
  char* p = static_cast<char*>(base);
  auto take = [&p](size_t bytes) {
    char* at = p;
    p += grouped::round_up(bytes);
    return at;
  };
  Fp8Arrays a;
  a.ptr_sfa = reinterpret_cast<const float**>(take(e * sizeof(void*)));
  a.ptr_sfb = reinterpret_cast<const float**>(take(e * sizeof(void*)));
  a.layout_sfa = reinterpret_cast<Fp8Gemm::LayoutSFA*>(take(e * sizeof(Fp8Gemm::LayoutSFA)));
  a.layout_sfb = reinterpret_cast<Fp8Gemm::LayoutSFB*>(take(e * sizeof(Fp8Gemm::LayoutSFB)));
  a.sfa = reinterpret_cast<float*>(
      take(static_cast<size_t>(rows) * static_cast<size_t>(k / kBlock) * sizeof(float)));
  a.gemm = p;
  return a;
}

// As grouped_problems.cuh's kernel (the same walk over offs, expert_rows_step), for the fp8
// operands:
// per expert the shapes, the K-major x rows and w[e] [n, k], the bf16 out rows, and the scales'
// pointers and layouts (A's scales: this expert's block of the reordered sfa).
__global__ void __launch_bounds__(32)
    build_fp8_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int k, int n,
                       const Fp8* x, const Fp8* w, const float* w_scales, Bf16* out,
                       grouped::Workspace ws, Fp8Arrays fa) {
  const int lane = static_cast<int>(threadIdx.x);
  const int kb = k / kBlock, nb = n / kBlock;
  int carry = 0;
  for (int base = 0; base < num_experts; base += 32) {
    const int e = base + lane;
    const grouped::ExpertRows r =
        grouped::expert_rows_step(offs, e, num_experts, rows, lane, carry);
    if (e >= num_experts) continue;
    const int m = r.end - r.begin;
    const int64_t b = r.begin, ee = e;
    ws.shapes[e] = grouped::Shape{m, n, k};
    ws.ptr_a[e] = reinterpret_cast<const Bf16*>(x + b * k);
    ws.ptr_b[e] = reinterpret_cast<const Bf16*>(w + ee * n * k);
    ws.ptr_d[e] = out + b * n;
    ws.stride_a[e] = k;
    ws.stride_b[e] = k;
    ws.stride_d[e] = grouped::StrideD{static_cast<int64_t>(n), cute::_1{}, cute::_0{}};
    fa.ptr_sfa[e] = fa.sfa + b * kb;
    fa.ptr_sfb[e] = w_scales + ee * kb * nb;
    fa.layout_sfa[e] = Fp8Gemm::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
    fa.layout_sfb[e] = Fp8Gemm::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
  }
}

// The rows' scales [rows, k / 128] (row-major, as the dispatch writes them) reordered per expert
// M-major: expert e's block at begin_e * kb holds [kb][rows_e]. Reads the shapes the problem
// kernel wrote. Grid (expert, slice): blockIdx.y slices an expert's rows x k-blocks, so a layer
// of few large experts still fills the GPU (one block per expert took 1.5 ms on two Mixtral
// experts' 16384 x 112 scales, longer than the GEMM's own share).
__global__ void reorder_row_scales(const grouped::Shape* __restrict__ shapes, int num_experts,
                                   const float* __restrict__ x_scales, int kb, float* sfa) {
  const int e = static_cast<int>(blockIdx.x);
  if (e >= num_experts) return;
  int64_t begin = 0;  // the sum of the earlier experts' rows
  for (int i = 0; i < e; ++i) begin += cute::get<0>(shapes[i]);
  const int64_t m = cute::get<0>(shapes[e]);
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x; i < m * kb;
       i += stride) {
    const int64_t r = i % m, c = i / m;
    sfa[begin * kb + c * m + r] = x_scales[(begin + r) * kb + c];
  }
}

Fp8Gemm::Gemm::Arguments fp8_arguments(const grouped::Workspace& ws, const Fp8Arrays& fa,
                                       int64_t num_experts, int device, int sm_count) {
  Fp8Gemm::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {static_cast<int>(num_experts), ws.shapes, nullptr};
  args.mainloop.ptr_A = reinterpret_cast<const Fp8**>(ws.ptr_a);
  args.mainloop.dA = reinterpret_cast<Fp8Gemm::StrideA*>(ws.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const Fp8**>(ws.ptr_b);
  args.mainloop.dB = reinterpret_cast<Fp8Gemm::StrideB*>(ws.stride_b);
  args.mainloop.ptr_SFA = fa.ptr_sfa;
  args.mainloop.layout_SFA = fa.layout_sfa;
  args.mainloop.ptr_SFB = fa.ptr_sfb;
  args.mainloop.layout_SFB = fa.layout_sfb;
  grouped::set_store_epilogue(args, ws, device, sm_count);
  return args;
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
  return Status::Ok();
}

size_t grouped_gemm_fp8_workspace_bytes(int64_t num_experts, int64_t rows, int64_t k,
                                        int sm_count) {
  if (num_experts < 1 || rows < 0 || k < kBlock || sm_count < 1) return 0;
  const size_t head = grouped::group_arrays_bytes(num_experts);
  const size_t fp8 = fp8_arrays_bytes(num_experts, rows, k);
  void* base = reinterpret_cast<void*>(grouped::kWorkspaceAlign);
  const grouped::Workspace ws = grouped::carve(base, num_experts);
  const Fp8Arrays fa = carve_fp8(base, num_experts, rows, k);
  return head + fp8 +
         Fp8Gemm::Gemm::get_workspace_size(fp8_arguments(ws, fa, num_experts, 0, sm_count));
}

Status grouped_gemm_fp8(const GroupedGemmFp8Problem& p, int device, int sm_count, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  if (Status s = grouped_gemm_fp8_supports(p); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  if (p.rows == 0) return Status::Ok();
  const size_t need = grouped_gemm_fp8_workspace_bytes(p.num_experts, p.rows, p.k, sm_count);
  if (Status s = grouped::check_workspace(workspace, workspace_bytes, need, "the fp8 grouped GEMM");
      !s.ok())
    return s;

  const grouped::Workspace ws = grouped::carve(workspace, p.num_experts);
  void* after = static_cast<char*>(workspace) + grouped::group_arrays_bytes(p.num_experts);
  Fp8Arrays fa = carve_fp8(after, p.num_experts, p.rows, p.k);
  const int experts = static_cast<int>(p.num_experts);
  build_fp8_problems<<<1, 32, 0, stream>>>(
      p.offs, experts, static_cast<int>(p.rows), static_cast<int>(p.k), static_cast<int>(p.n),
      static_cast<const Fp8*>(p.x), static_cast<const Fp8*>(p.w), p.w_scales,
      static_cast<Bf16*>(p.out), ws, fa);
  const dim3 reorder_grid(experts, std::max(1, std::min(1024, 8 * sm_count / experts)));
  reorder_row_scales<<<reorder_grid, 256, 0, stream>>>(ws.shapes, experts, p.x_scales,
                                                       static_cast<int>(p.k / kBlock), fa.sfa);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the fp8 grouped GEMM's problem kernels failed to launch: ",
                            cudaGetErrorString(e))};

  const Fp8Gemm::Gemm::Arguments args = fp8_arguments(ws, fa, p.num_experts, device, sm_count);
  Fp8Gemm::Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return {StatusCode::kUnsupported, "the fp8 grouped GEMM cannot implement these operands"};
  cutlass::Status s = gemm.initialize(args, fa.gemm, stream);
  if (s == cutlass::Status::kSuccess) s = gemm.run(stream);
  if (s != cutlass::Status::kSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the fp8 grouped GEMM failed to launch: ", cutlassGetStatusString(s),
                            " (", cudaGetErrorString(cudaGetLastError()), ")")};
  return Status::Ok();
}

}  // namespace uniep::cuda
