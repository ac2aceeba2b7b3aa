// The fp8 blockwise-scaled mainloop with its scale promotion off the tensor cores' path.
//
// Why: CUTLASS's blockwise ptr-array mainloop issues a k-block's WGMMAs into a temporary
// accumulator, then waits for all of them (warpgroup_wait<0>) before it multiplies the partial
// sum by the block's scales and adds it to the accumulator, and only then issues the next
// k-block. Each warpgroup's tensor-core work therefore stops at every 128-deep k-block for the
// WGMMA tail and the promotion. On one H100 that kernel ran the layer's products at 860-1050
// TFLOP/s where cuBLAS's per-tensor fp8 GEMM of the same shape ran at 1260-1450 (2026-11-28,
// commit 774ea19).
//
// How: two temporary accumulators. The WGMMAs of k-block t go into one while the other still
// holds k-block t - 1; after issuing t, warpgroup_wait<1> waits for t - 1 only, whose stage is
// released and whose partial sum is promoted while t runs. The promotion is the base's, in the
// same order (the scales multiplied first, then accum += partial * scale, k-block by k-block),
// and every partial sum is the same WGMMA chain from zero, so the bits are the base's. The
// accumulator is cleared first (the base's first promotion adds into it as well).
//
// Measured against the base on one H100, interleaved, same bits (x-fp8-pipelined-h100.json):
// 0.90-0.93x the time on DeepSeek-V3's and Mixtral's products (1064-1108 TFLOP/s, cuBLAS's
// 1x128 / 128x128 blockwise GEMM ran at 1091-1176 on one matrix of the same FLOPs), 0.96-0.98x
// on the Qwen3-like load's small experts.
//
// Costs one more accumulator of registers: 64 x 128 per warpgroup is 64 floats a thread, so 192
// with the two temporaries, inside the cooperative consumers' 232. Only the layouts this engine
// uses: per-row A scales with one B scale per tile along N or one per 64 columns, and, with the
// operands' roles swapped (SwapGemm, fp8_kernel.cuh), one A scale per tile along M with per-row
// (per-column of the tile) B scales.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

namespace uniep::cuda::grouped_fp8 {

template <class Base>
struct PipelinedScaleMainloop : Base {
  static_assert(Base::ScaleMsPerTile > 1 || Base::ScaleNsPerTile > 1,
                "written for per-row A scales or per-column B scales");
  static_assert(Base::ScalePromotionInterval == 4,
                "written for one promotion per k-block (the scale block is the k-tile)");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Base::MainloopPipeline pipeline,
                          typename Base::PipelineState smem_pipe_read, FrgTensorC& accum,
                          int k_tile_count, int thread_idx,
                          typename Base::TensorStorage& shared_tensors,
                          const typename Base::Params& /*params*/) {
    using namespace cute;
    using TileShape = typename Base::TileShape;
    using SmemLayoutSFA = typename Base::SmemLayoutSFA;
    using SmemLayoutSFB = typename Base::SmemLayoutSFB;
    using TiledMma = typename Base::TiledMma;
    using Scale = typename Base::ElementBlockScale;

    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    // The scales as (BLK_M, BLK_N, (BLK_K, PIPE)) views, broadcast along the other mode, so that
    // partitioning them like C gives each thread the scales of its accumulators.
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(
            make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                       make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
            make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                        make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(
            make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                       make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
            make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                        make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
    const Layout warp_group_thread_layout =
        make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
    const int warp_group_idx =
        __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
    TiledMma tiled_mma;
    auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    Tensor tCsA = thread_mma.partition_A(sA);
    Tensor tCsB = thread_mma.partition_B(sB);
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);  // (MMA, MMA_N, MMA_K, PIPE)

    // Two of each: k-block t's partial sum and scales beside k-block t - 1's.
    Tensor part0 = make_fragment_like(accum);
    Tensor part1 = make_fragment_like(accum);
    Tensor sfa0 = make_tensor_like<Scale>(tCsSFA(_, _, _, _0{}));
    Tensor sfa1 = make_tensor_like<Scale>(tCsSFA(_, _, _, _0{}));
    Tensor sfb0 = make_tensor_like<Scale>(tCsSFB(_, _, _, _0{}));
    Tensor sfb1 = make_tensor_like<Scale>(tCsSFB(_, _, _, _0{}));

    clear(accum);
    if (k_tile_count <= 0) return;
    typename Base::PipelineState smem_pipe_release = smem_pipe_read;

    // Waits for the next stage, reads its scales and issues its WGMMAs into `part`.
    auto issue = [&](auto& part, auto& sfa, auto& sfb) {
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), sfa);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), sfb);
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
      ++smem_pipe_read;
    };
    // accum += part * (row scale * B scale): the scales' product first, then one fused
    // multiply-add, the base's order of operations. With several B scales along N (w1 packed for
    // the SwiGLU epilogue, a scale per 64 columns; the swapped product's per-row scales) the
    // product is formed per element; it is the same product (a float product does not depend
    // on its operands' order), so the bits are those of one scale per tile.
    auto promote = [&](auto& part, auto& sfa, auto& sfb) {
      warpgroup_fence_operand(part);
      warpgroup_fence_operand(accum);
      if constexpr (Base::ScaleNsPerTile == 1) {
        const Scale scale_b = sfb(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(sfa)); ++i)
          filter_zeros(sfa)(i) = filter_zeros(sfa)(i) * scale_b;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * sfa(i);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) {
          const Scale scale = sfa(i) * sfb(i);
          accum(i) += part(i) * scale;
        }
      }
      warpgroup_fence_operand(accum);
    };
    // After issuing k-block t: wait for t - 1 only, free its stage, promote it.
    auto retire_previous = [&](auto& part, auto& sfa, auto& sfb) {
      warpgroup_wait<1>();
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      promote(part, sfa, sfb);
    };

    issue(part0, sfa0, sfb0);
    for (int t = 1;; t += 2) {
      if (t >= k_tile_count) {
        warpgroup_wait<0>();
        promote(part0, sfa0, sfb0);
        break;
      }
      issue(part1, sfa1, sfb1);
      retire_previous(part0, sfa0, sfb0);
      if (t + 1 >= k_tile_count) {
        warpgroup_wait<0>();
        promote(part1, sfa1, sfb1);
        break;
      }
      issue(part0, sfa0, sfb0);
      retire_previous(part1, sfa1, sfb1);
    }
    // The last k-block's stage is mma_tail's to release, as in the base.
  }
};

}  // namespace uniep::cuda::grouped_fp8
