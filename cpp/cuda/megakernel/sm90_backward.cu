// moe_fused_backward_rows_bf16 (include/uniep/cuda/fused_moe_backward.hpp): the send of x's and
// grad_out's rows and the two GEMMs that need only those rows, as one persistent launch. The
// GEMM body is the gated GEMM's own (gated_run.cuh, the store epilogue) over 2E groups, so the
// bits are the sequential path's.
//
// Every CTA sends first (world 1 measured fastest so for the forward, and there is no other rank
// to wait for), then takes tiles: a tile waits only on rows, which every CTA stores before it
// takes any tile, and the persistent grid is resident, so the waits cannot close a cycle.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/cta_index.cuh"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/checks.hpp"
#include "cuda/megakernel/gated_run.cuh"
#include "cuda/megakernel/problems.cuh"
#include "cuda/megakernel/stages.cuh"
#include "uniep/cuda/fused_moe_backward.hpp"

namespace uniep::cuda {
namespace megakernel {
namespace {

using BackwardGemm = GatedGemm<grouped::GroupedEpilogue::kStore>;
using BackwardKernel = typename BackwardGemm::Kernel;

// Groups [0, E): x rows times w1[e] into h; groups [E, 2E): grad_out rows times w2t[e] into
// grad_act. One warp.
__global__ void __launch_bounds__(32)
    backward_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int hidden,
                      int ffn, const grouped::Bf16* rows_x, const grouped::Bf16* rows_go,
                      const grouped::Bf16* w1, const grouped::Bf16* w2t, grouped::Bf16* h,
                      grouped::Bf16* grad_act, grouped::Workspace ws) {
  set_fused_problems(offs, num_experts, rows, static_cast<int>(threadIdx.x), ws,
                     {rows_x, w1, h, hidden, 2 * ffn, 2 * ffn},
                     {rows_go, w2t, grad_act, hidden, ffn, ffn});
}

// Warp `warp` of `warps` takes tokens warp, warp + warps, ...: each token's x row and grad_out
// row go to all of its GEMM rows (each read once), then each row is counted once on its tile.
// With peers the rows go to their experts' ranks, each with its source slot and routing weight
// (what the element-wise pass and the return need there), published at system scope.
__device__ __forceinline__ void backward_send_tokens(const FusedBackwardArgs& a, int64_t warp,
                                                     int64_t warps, int lane) {
  const int64_t pieces = a.hidden * 2 / 16, K = a.top_k;
  const bool peers = a.peers.row_src[0] != nullptr;
  const auto* x = static_cast<const int4*>(a.x);
  const auto* go = static_cast<const int4*>(a.grad_out);
  for (int64_t t = warp; t < a.tokens; t += warps) {
    int4* dst_x = nullptr;
    int4* dst_go = nullptr;
    uint32_t* signal = nullptr;
    if (lane < K) {
      const int64_t i = t * K + lane;
      with_entry_dest(a, i, peers, [&](int64_t r, int64_t c, int64_t d) {
        if (peers) {
          dst_x = static_cast<int4*>(a.peers.rows_x[d]) + r * pieces;
          dst_go = static_cast<int4*>(a.peers.rows_go[d]) + r * pieces;
          signal = a.peers.counters[d] + c;
          a.peers.row_src[d][r] = a.peers.rank * a.peers.slots_per_rank + i;
          a.peers.row_w[d][r] = a.topk_weights[i];
        } else {
          dst_x = static_cast<int4*>(a.rows_x) + r * pieces;
          dst_go = static_cast<int4*>(a.rows_go) + r * pieces;
          signal = a.counters + c;
        }
      });
    }
    store_token_row(x + t * pieces, dst_x, pieces, static_cast<int>(K), lane);
    store_token_row(go + t * pieces, dst_go, pieces, static_cast<int>(K), lane);
    publish_token_rows(signal, peers);
  }
}

__global__ void __launch_bounds__(BackwardKernel::MaxThreadsPerBlock,
                                  BackwardKernel::MinBlocksPerMultiprocessor)
    fused_backward_kernel(const __grid_constant__ typename BackwardKernel::Params params,
                          const __grid_constant__ FusedBackwardArgs a) {
  extern __shared__ char smem[];
  constexpr int kWarps = static_cast<int>(BackwardKernel::MaxThreadsPerBlock) / 32;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t ctas = int64_t(gridDim.x) * gridDim.y * gridDim.z;
  const int64_t cta = cta_linear_index();
  unsigned long long* trace = a.trace != nullptr ? a.trace + 4 * cta : nullptr;
  if (trace != nullptr && threadIdx.x == 0) trace[0] = global_timer_ns();
  backward_send_tokens(a, cta * kWarps + warp, ctas * kWarps, lane);
  __syncthreads();
  if (trace != nullptr && threadIdx.x == 0) trace[1] = global_timer_ns();
  BackwardKernel{}(params, smem);
  if (trace != nullptr && threadIdx.x >= 128) {
    // The consumer warpgroups (the producer's ran ahead): the CTA's tiles end with their last.
    asm volatile("bar.sync 15, %0;" ::"n"(256) : "memory");
    if (threadIdx.x == 128) trace[2] = trace[3] = global_timer_ns();  // no reduce: [3] = [2]
  }
}

Status check_args(const FusedBackwardArgs& a) {
  if (Status s = check_layer_sizes(a.tokens, a.top_k, a.hidden, a.ffn, a.num_experts); !s.ok())
    return s;
  if (a.capacity < a.tokens * a.top_k || a.capacity > (1ll << 31) - 1)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("capacity must be in [tokens x top_k = ", a.tokens * a.top_k,
                            ", 2^31), got ", a.capacity)};
  if (a.num_counters < a.capacity / kGatedTileM + a.num_experts)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("num_counters must be >= capacity / ", kGatedTileM, " + E = ",
                            a.capacity / kGatedTileM + a.num_experts, ", got ", a.num_counters)};
  if (!all_set({a.x, a.grad_out, a.gemm_row, a.counter, a.w1, a.w2t, a.offs, a.tile_base, a.rows_x,
                a.rows_go, a.h, a.grad_act, a.counters, a.error, a.timeout}))
    return {StatusCode::kInvalidArgument,
            "moe_fused_backward_rows_bf16: every pointer of FusedBackwardArgs must be a device "
            "pointer"};
  if (a.peers.row_src[0] != nullptr) {
    if (a.peers.world_size < 1 || a.peers.world_size > kMaxFusedPeers || a.peers.rank < 0 ||
        a.peers.rank >= a.peers.world_size || a.peers.slots_per_rank < a.tokens * a.top_k)
      return {
          StatusCode::kInvalidArgument,
          detail::str_cat("peers: world_size must be in [1, ", kMaxFusedPeers,
                          "], rank in [0, world_size) and slots_per_rank >= tokens x top_k, "
                          "got ",
                          a.peers.world_size, ", ", a.peers.rank, " and ", a.peers.slots_per_rank)};
    if (a.tokens > 0 && (a.dest_rank == nullptr || a.topk_weights == nullptr))
      return {StatusCode::kInvalidArgument,
              "moe_fused_backward_rows_bf16: with peers, dest_rank and topk_weights must be "
              "device pointers"};
    for (int p = 0; p < a.peers.world_size; ++p)
      if (a.peers.rows_x[p] == nullptr || a.peers.rows_go[p] == nullptr ||
          a.peers.row_src[p] == nullptr || a.peers.row_w[p] == nullptr ||
          a.peers.counters[p] == nullptr)
        return {StatusCode::kInvalidArgument,
                detail::str_cat("moe_fused_backward_rows_bf16: peers' buffers of rank ", p,
                                " must be device pointers")};
  }
  if (!all_aligned16({a.x, a.grad_out, a.w1, a.w2t, a.rows_x, a.rows_go, a.h, a.grad_act}))
    return {StatusCode::kInvalidArgument,
            "moe_fused_backward_rows_bf16: x, grad_out, w1, w2t, rows_x, rows_go, h and "
            "grad_act must be 16-byte aligned"};
  return Status::Ok();
}

}  // namespace
}  // namespace megakernel

size_t fused_moe_backward_workspace_bytes(int64_t num_experts, int sm_count) {
  if (num_experts < 1 || num_experts > (1 << 20) || sm_count < 1) return 0;
  return grouped::group_arrays_bytes(2 * num_experts) +
         megakernel::gated_gemm_workspace<grouped::GroupedEpilogue::kStore>(2 * num_experts,
                                                                            sm_count);
}

Status moe_fused_backward_rows_bf16(const FusedBackwardArgs& a, int sm_count, int device,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  using megakernel::BackwardGemm;
  using megakernel::BackwardKernel;
  if (Status s = megakernel::check_args(a); !s.ok()) return s;
  if (Status s = megakernel::launch_sm_count(device, sm_count, "the fused MoE backward",
                                             "moe_fused_backward_rows_bf16", sm_count);
      !s.ok())
    return s;
  // A rank with no tokens still computes its peers' rows.
  if (a.tokens == 0 && a.peers.row_src[0] == nullptr) return Status::Ok();
  const size_t need = fused_moe_backward_workspace_bytes(a.num_experts, sm_count);
  if (Status s =
          grouped::check_workspace(workspace, workspace_bytes, need, "the fused MoE backward");
      !s.ok())
    return s;

  const grouped::Workspace ws = grouped::carve(workspace, 2 * a.num_experts);
  megakernel::backward_problems<<<1, 32, 0, stream>>>(
      a.offs, static_cast<int>(a.num_experts), static_cast<int>(a.capacity),
      static_cast<int>(a.hidden), static_cast<int>(a.ffn),
      static_cast<const grouped::Bf16*>(a.rows_x), static_cast<const grouped::Bf16*>(a.rows_go),
      static_cast<const grouped::Bf16*>(a.w1), static_cast<const grouped::Bf16*>(a.w2t),
      static_cast<grouped::Bf16*>(a.h), static_cast<grouped::Bf16*>(a.grad_act), ws);
  if (Status s = launch_status("the fused MoE backward's problem kernel"); !s.ok()) return s;

  const TileGate gate = megakernel::stored_rows_gate(a.counters, a.num_counters, a.tile_base,
                                                     a.timeout_ns, a.timeout);
  auto args = megakernel::gated_arguments<grouped::GroupedEpilogue::kStore>(
      ws, 2 * a.num_experts, gate, GatedSignal{}, device, sm_count, 0);
  // Both halves wait on the same rows: group E + e is expert e's too.
  args.mainloop.gate2 = gate;
  args.mainloop.split = static_cast<int32_t>(a.num_experts);
  typename BackwardKernel::Params params;
  if (Status s =
          body_params<BackwardKernel>(args, ws.gemm, stream, "the fused MoE backward", &params);
      !s.ok())
    return s;
  return launch_with_body<BackwardKernel>(megakernel::fused_backward_kernel, params, stream,
                                          "moe_fused_backward_rows_bf16", /*after_prior=*/false, a);
}

}  // namespace uniep::cuda
