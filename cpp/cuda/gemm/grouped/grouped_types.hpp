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
// Row-major x (M x K) is K-major; row-major w[e] (K x N) is N-major; row-major out is N-major.
using StrideA = cute::Stride<int64_t, cute::_1, cute::_0>;
using StrideB = cute::Stride<cute::_1, int64_t, cute::_0>;
using StrideD = cute::Stride<int64_t, cute::_1, cute::_0>;

}  // namespace uniep::cuda::grouped
