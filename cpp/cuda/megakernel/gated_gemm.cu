// grouped_gemm_gated_bf16 (include/uniep/cuda/tile_gate.hpp): the engine's checks and problem
// kernel, then the gated configuration of the chosen epilogue.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/gemm/grouped/grouped_problems.cuh"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/gated_run.cuh"
#include "uniep/cuda/send_rows.hpp"

namespace uniep::cuda {

size_t grouped_gemm_gated_workspace_bytes(int64_t num_experts, int sm_count) {
  if (num_experts < 1 || num_experts > (1ll << 31) - 1 || sm_count < 1) return 0;
  return grouped::group_arrays_bytes(num_experts) +
         std::max({megakernel::gated_store_workspace(num_experts, sm_count),
                   megakernel::gated_swiglu_workspace(num_experts, sm_count),
                   megakernel::gated_swiglu_plain_workspace(num_experts, sm_count)});
}

Status grouped_gemm_gated_bf16(const GroupedGemmProblem& p, const TileGate& gate,
                               const GatedSignal& signal, int device, int sm_count, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream) {
  if (Status s = grouped_gemm_supports(p); !s.ok()) return s;
  if (p.kind != GroupedGemmKind::kForward)
    return {StatusCode::kInvalidArgument,
            "the gated grouped GEMM runs the forward (kForward) only"};
  if (p.epilogue == GroupedGemmEpilogue::kStoreF32)
    return {StatusCode::kUnsupported,
            "the gated grouped GEMM stores bf16 (epilogue kStore, kSwiGlu or kSwiGluPlain)"};
  const bool swiglu = p.epilogue != GroupedGemmEpilogue::kStore;
  const bool plain = p.epilogue == GroupedGemmEpilogue::kSwiGluPlain;
  if (plain && (p.n / 2) % (kGatedTileN / 2) != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat("the gated GEMM's SwiGLU epilogue on w1 as stored needs the FFN size "
                            "(n / 2) to be a multiple of ",
                            kGatedTileN / 2, " (its tiles are ", kGatedTileN,
                            " columns wide), got ", p.n / 2)};
  if (gate.counters != nullptr && (gate.tile_base == nullptr || gate.timeout == nullptr))
    return {StatusCode::kInvalidArgument,
            "gate: with counters, tile_base (gate_tile_base) and timeout must be device pointers"};
  if (gate.counters == nullptr && gate.ready != nullptr && gate.timeout == nullptr)
    return {StatusCode::kInvalidArgument,
            "gate: with ready words, timeout must be a device pointer"};
  if (gate.counters != nullptr && gate.num_counters < 1)
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat("gate: num_counters must be >= 1 with counters, got ", gate.num_counters)};
  if (signal.done != nullptr && !swiglu)
    return {StatusCode::kInvalidArgument,
            "signal: the done signal belongs to the SwiGLU epilogue (epilogue kSwiGlu or "
            "kSwiGluPlain)"};
  if (signal.done != nullptr && (signal.done_base == nullptr || signal.num_done < 1))
    return {StatusCode::kInvalidArgument,
            "signal: done needs done_base (gate_tile_base) and num_done >= 1"};
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  if (p.rows == 0) return Status::Ok();
  // The send that releases this GEMM's tiles is launched after it (streams overlap): loaded now,
  // its launch cannot wait for this kernel to finish (lazy module loading).
  if (gate.counters != nullptr)
    if (Status s = preload_send_rows_kernels(); !s.ok()) return s;
  const size_t need = grouped_gemm_gated_workspace_bytes(p.num_experts, sm_count);
  if (Status s = grouped::check_workspace(workspace, workspace_bytes, need, "the gated GEMM");
      !s.ok())
    return s;

  const grouped::Workspace ws = grouped::carve(workspace, p.num_experts);
  const int64_t out_n = swiglu ? p.n / 2 : p.n;
  grouped::build_grouped_problems<grouped::GroupedKind::kForward><<<1, 32, 0, stream>>>(
      p.offs, static_cast<int>(p.num_experts), static_cast<int>(p.rows), static_cast<int>(p.k),
      static_cast<int>(p.n), static_cast<int>(out_n), static_cast<const grouped::Bf16*>(p.x),
      static_cast<const grouped::Bf16*>(p.w), static_cast<grouped::Bf16*>(p.out), ws);
  if (Status s = launch_status("the gated GEMM's problem kernel"); !s.ok()) return s;
  if (plain)
    return megakernel::gated_swiglu_plain_run(
        ws, p.num_experts, gate, signal, out_n, device, sm_count, stream,
        grouped::PlainW1{static_cast<const grouped::Bf16*>(p.w), p.k, p.n});
  return swiglu ? megakernel::gated_swiglu_run(ws, p.num_experts, gate, signal, out_n, device,
                                               sm_count, stream)
                : megakernel::gated_store_run(ws, p.num_experts, gate, device, sm_count, stream);
}

}  // namespace uniep::cuda
