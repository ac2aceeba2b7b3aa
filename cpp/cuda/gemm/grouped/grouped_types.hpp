// The types every grouped GEMM configuration shares: bf16 operands, one (M, N, K) shape and one
// stride of each operand per group, row-major everywhere. Split from grouped_kernel.cuh so the
// problem kernel and the workspace layout need no CUTLASS collective.
#pragma once

#include <cutlass/bfloat16.h>
#include <cutlass/layout/matrix.h>
#include <cute/tensor.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>

#include <cstdint>

namespace uniep::cuda::grouped {

using Bf16 = cutlass::bfloat16_t;
// Pointer layout tags select the grouped kernels: one pointer and one stride per group.
using RowMajorArray = cutlass::layout::RowMajor*;
constexpr int kAlign = 16 / sizeof(Bf16);  // TMA moves 16-byte aligned rows

// (M, N, K) of one group; filled on the device (grouped_problems.cuh).
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape = ProblemShape::UnderlyingProblemShape;
// CUTLASS's A is (M, K), B is (N, K), D is (M, N); one dynamic stride each, the other mode
// contiguous, the batch mode unused (groups have their own pointers).
using KMajorA = cute::Stride<int64_t, cute::_1, cute::_0>;  // row-major x [M, K]
using MMajorA = cute::Stride<cute::_1, int64_t, cute::_0>;  // x^T of a row-major x [K, M]
using NMajorB = cute::Stride<cute::_1, int64_t, cute::_0>;  // row-major w [K, N]
using KMajorB = cute::Stride<int64_t, cute::_1, cute::_0>;  // w^T of a row-major w [N, K]
using StrideD = cute::Stride<int64_t, cute::_1, cute::_0>;  // row-major out [M, N]
// The workspace holds every stride in one 8-byte slot, whichever its type.
static_assert(sizeof(KMajorA) == 8 && sizeof(MMajorA) == 8 && sizeof(NMajorB) == 8 &&
              sizeof(KMajorB) == 8 && sizeof(StrideD) == 8);

// The three grouped products (include/uniep/cuda/grouped_gemm.hpp, GroupedGemmKind):
//   kForward  out[rows of e] = x[rows of e] w[e]      (x K-major, w[e] N-major)
//   kDgrad    out[rows of e] = dy[rows of e] w[e]^T   (dy K-major, w[e]^T K-major)
//   kWgrad    out[e] = x[rows of e]^T dy[rows of e]   (x^T M-major, dy N-major; K = the rows)
enum class GroupedKind { kForward, kDgrad, kWgrad };

// kSwiGluPlain's weight: w1 [E, k, n] as stored (gate columns [0, n / 2), then up).
struct PlainW1 {
  const Bf16* w1 = nullptr;
  int64_t k = 0, n = 0;
};

template <GroupedKind Kind>
struct KindLayouts;
template <>
struct KindLayouts<GroupedKind::kForward> {
  using LayoutA = cutlass::layout::RowMajor*;
  using LayoutB = cutlass::layout::RowMajor*;
  using StrideA = KMajorA;
  using StrideB = NMajorB;
};
template <>
struct KindLayouts<GroupedKind::kDgrad> {
  using LayoutA = cutlass::layout::RowMajor*;
  using LayoutB = cutlass::layout::ColumnMajor*;
  using StrideA = KMajorA;
  using StrideB = KMajorB;
};
template <>
struct KindLayouts<GroupedKind::kWgrad> {
  using LayoutA = cutlass::layout::ColumnMajor*;
  using LayoutB = cutlass::layout::RowMajor*;
  using StrideA = MMajorA;
  using StrideB = NMajorB;
};

}  // namespace uniep::cuda::grouped
