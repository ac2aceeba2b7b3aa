// moe_fused_forward_bf16 (include/uniep/cuda/fused_moe.hpp): the MegaKernel's forward as one
// persistent launch. The kernel itself is in kernel.cuh, instantiated per tile shape in
// sm90_forward_<shape>.cu (launch.hpp); here are the argument checks, the problem arrays both
// GEMMs read, the bandwidth model of skip_rounds and the choice of the tile.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "cuda/gemm/grouped/launch_status.hpp"
#include "cuda/megakernel/checks.hpp"
#include "cuda/megakernel/launch.hpp"
#include "cuda/megakernel/local_plan.cuh"
#include "cuda/megakernel/problems.cuh"
#include "uniep/cuda/fused_moe.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/tuning.hpp"

namespace uniep::cuda {
namespace megakernel {
namespace {

// What fused_problems zeroes besides the scratch (FusedMoeArgs::zero_state): the three counter
// arrays, the error word and the timeout record; null pointers when the caller zeroed them.
struct FusedZeroState {
  uint32_t* counters[3] = {};
  int64_t num_counters = 0;
  unsigned long long* error = nullptr;
  GateTimeout* timeout = nullptr;
};

constexpr int kProblemThreads = 256;

// Groups [0, E): x rows times w1_packed[e] (SwiGLU into act); groups [E, 2E): act rows times
// w2[e] into y. Block 0's first warp writes them and readies the launch's scratch
// (FusedScratch); every thread of the grid zeroes `zero`'s state.
__global__ void __launch_bounds__(kProblemThreads)
    fused_problems(const int32_t* __restrict__ offs, int num_experts, int rows, int hidden, int ffn,
                   const grouped::Bf16* x_rows, const grouped::Bf16* w1, const grouped::Bf16* w2,
                   grouped::Bf16* act, grouped::Bf16* y, grouped::Workspace ws,
                   FusedScratch scratch, FusedZeroState zero) {
  // Launched while the plan kernel may still run (the launch below): offs is read after this.
  wait_for_prior_grid();
  // The MegaKernel behind this kernel may start its CTAs now; it waits for this one's end.
  allow_next_grid();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kProblemThreads;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kProblemThreads) + threadIdx.x;
       i < zero.num_counters; i += stride) {
#pragma unroll
    for (uint32_t* c : zero.counters)
      if (c != nullptr) c[i] = 0;
  }
  if (blockIdx.x != 0 || threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  if (lane == 0) {
    *scratch.reduce_ticket = 0;
    if (zero.error != nullptr) *zero.error = 0;
    if (zero.timeout != nullptr) *zero.timeout = GateTimeout{0u, 0, 0, 0u, 0u};  // as a memset
  }
  // Each consumer warp's held GEMM-2 signal starts empty: a CTA without tiles never writes its
  // slots. Here, not in the kernel, where the index stayed live across the GEMM body and spilled.
  for (int64_t i = lane; i < scratch.num_held; i += 32) scratch.held[i] = nullptr;
  set_fused_problems(offs, num_experts, rows, lane, ws, {x_rows, w1, act, hidden, 2 * ffn, ffn},
                     {act, w2, y, ffn, hidden, hidden});
}

static_assert(kFusedPlanMaxEntries == local_plan::kOneBlockEntries &&
                  kFusedPlanMaxExperts == local_plan::kLocalExperts,
              "the planned launch's public bounds are what one block of the plan takes");

// fused_problems' work and the routing's plan in one block (moe_fused_forward_planned_bf16):
// the plan's rows and tile counters (local_plan::plan_one_block), each expert's two groups
// written as its row range is known, and the launch's state zeroed. One launch boundary fewer
// ahead of the MegaKernel than the plan and fused_problems apart.
__global__ void __launch_bounds__(local_plan::kThreads)
    fused_plan_problems(FusedLocalPlan plan, int64_t entries, int num_experts, int tile_m,
                        int hidden, int ffn, const grouped::Bf16* x_rows, const grouped::Bf16* w1,
                        const grouped::Bf16* w2, grouped::Bf16* act, grouped::Bf16* y,
                        grouped::Workspace ws, FusedScratch scratch, FusedZeroState zero) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int64_t i = tid; i < zero.num_counters; i += local_plan::kThreads) {
#pragma unroll
    for (uint32_t* c : zero.counters) c[i] = 0;
  }
  for (int64_t i = tid; i < scratch.num_held; i += local_plan::kThreads) scratch.held[i] = nullptr;
  unsigned long long* plan_error = plan.error != nullptr ? plan.error : zero.error;
  if (tid == 0) {
    *scratch.reduce_ticket = 0;
    *zero.timeout = GateTimeout{0u, 0, 0, 0u, 0u};  // as a memset
    if (plan_error != zero.error) *zero.error = 0;
  }
  const FusedGemmOperands first{x_rows, w1, act, hidden, 2 * ffn, ffn};
  const FusedGemmOperands second{act, w2, y, ffn, hidden, hidden};
  // The plan zeroes its error word before it reports a bad id there.
  local_plan::plan_one_block(
      plan.topk_idx, entries, num_experts, tile_m, plan.counts, plan.offs, plan.tile_base, nullptr,
      plan.gemm_row, plan.counter, plan_error,
      // The MegaKernel behind this kernel may start its CTAs now; it waits for this one's end.
      [] { allow_next_grid(); },
      [&](int e, int start, int count) {
        set_fused_expert_problems(e, num_experts, grouped::ExpertRows{start, start + count}, ws,
                                  first, second);
      });
}

__global__ void fused_row_entries_kernel(const int64_t* __restrict__ gemm_row, int64_t entries,
                                         int64_t capacity, int64_t* __restrict__ row_entry) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < entries;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = gemm_row[i];
    if (r >= 0 && r < capacity) row_entry[r] = i;
  }
}

const FusedEntry* const* fused_entries(int* count) {
  static const FusedEntry* const entries[] = {
      &fused_entry_128(),        &fused_entry_64(),        &fused_entry_64_n128(),
      &fused_entry_128_stored(), &fused_entry_64_stored(), &fused_entry_64_n128_stored()};
  *count = static_cast<int>(sizeof(entries) / sizeof(entries[0]));
  return entries;
}

// The workspace is sized before the call's shape is known: the largest of every instantiation's.
size_t gemm_workspace(int64_t num_experts, int sm_count) {
  int count = 0;
  const FusedEntry* const* entries = fused_entries(&count);
  size_t most = 0;
  for (int i = 0; i < count; ++i)
    most = std::max(most, entries[i]->gemm_workspace(num_experts, sm_count));
  return most;
}

const FusedEntry* find_entry(int tile_m, int tile_n, bool w1_as_stored) {
  int count = 0;
  const FusedEntry* const* entries = fused_entries(&count);
  for (int i = 0; i < count; ++i)
    if (entries[i]->tile_m == tile_m && entries[i]->tile_n == tile_n &&
        entries[i]->w1_as_stored == w1_as_stored)
      return entries[i];
  return nullptr;
}

Status check_args(const FusedMoeArgs& a, int tile_m, int tile_n) {
  if (Status s = check_layer_sizes(a.tokens, a.top_k, a.hidden, a.ffn, a.num_experts); !s.ok())
    return s;
  if (a.w1_as_stored && a.ffn % (tile_n / 2) != 0)
    return {StatusCode::kUnsupported,
            detail::str_cat("ffn must be a multiple of ", tile_n / 2, " with w1_as_stored (each ",
                            tile_n, "-wide tile of GEMM 1 reads ", tile_n / 2, " gate and ",
                            tile_n / 2, " up columns of w1 as stored); got ", a.ffn,
                            ": pass pack_gate_up's layout instead")};
  // With peers the rows are other ranks' too; the runtime sizes them for the most any rank gets.
  if ((a.peers.world_size == 1 && a.capacity < a.tokens * a.top_k) || a.capacity < 0 ||
      a.capacity > (1ll << 31) - 1)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("capacity must be in [tokens x top_k = ", a.tokens * a.top_k,
                            ", 2^31), got ", a.capacity)};
  if (a.num_counters < a.capacity / tile_m + a.num_experts)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("num_counters must be >= capacity / tile_m + E = ",
                            a.capacity / tile_m + a.num_experts, ", got ", a.num_counters)};
  const FusedPeers& p = a.peers;
  if (p.world_size < 1 || p.world_size > kMaxFusedPeers || p.rank < 0 || p.rank >= p.world_size)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("peers.world_size must be in [1, ", kMaxFusedPeers,
                            "] and peers.rank in [0, world_size), got ", p.world_size, " and ",
                            p.rank)};
  const bool peers = p.world_size > 1;
  // row_entry (the row-order send at world 1) is checked with the launch.
  if (!all_set({a.x, a.topk_weights, a.gemm_row, a.counter, a.w1_packed, a.w2, a.offs, a.tile_base,
                a.rows, a.act, peers ? a.act : a.y, a.out, a.counters, a.done1, a.done2, a.error,
                a.timeout}))
    return {StatusCode::kInvalidArgument,
            "moe_fused_forward_bf16: every pointer of FusedMoeArgs must be a device pointer"};
  for (int d = 0; peers && d < p.world_size; ++d)
    if (p.rows[d] == nullptr || p.row_src[d] == nullptr || p.counters[d] == nullptr ||
        p.combine[d] == nullptr || p.done2[d] == nullptr)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("moe_fused_forward_bf16: peers.rows, row_src, counters, combine "
                              "and done2 of rank ",
                              d, " must be device pointers (nvshmem_ptr mappings)")};
  if (peers && (p.combine_table == nullptr || p.slots_per_rank < a.tokens * a.top_k))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("moe_fused_forward_bf16: with peers, combine_table must be a device "
                            "array and slots_per_rank >= tokens x top_k = ",
                            a.tokens * a.top_k, ", got ", p.slots_per_rank)};
  if (peers && a.dest_rank == nullptr)
    return {StatusCode::kInvalidArgument,
            "moe_fused_forward_bf16: dest_rank must be a device pointer with peers"};
  if (peers &&
      (p.rows[p.rank] != a.rows || p.counters[p.rank] != a.counters || p.done2[p.rank] != a.done2))
    return {StatusCode::kInvalidArgument,
            "moe_fused_forward_bf16: peers' entries at peers.rank must be rows, counters and "
            "done2 themselves"};
  if (a.parity_epoch != nullptr && a.done2_parity_stride < a.num_counters)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("moe_fused_forward_bf16: with parity_epoch, done2_parity_stride must "
                            "be >= num_counters = ",
                            a.num_counters, ", got ", a.done2_parity_stride)};
  if (!all_aligned16({a.x, a.w1_packed, a.w2, a.rows, a.act, peers ? a.act : a.y, a.out}))
    return {StatusCode::kInvalidArgument,
            "moe_fused_forward_bf16: x, w1_packed, w2, rows, act, y and out must be 16-byte "
            "aligned"};
  return Status::Ok();
}

}  // namespace
}  // namespace megakernel

int fused_default_skip_rounds(int64_t rows, int64_t hidden, int comm_ctas, int world_size,
                              int tile_m, int tile_n) {
  // The send reads and writes every row once, at about 60 GB/s per communicating SM; with peers
  // the share of the rows bound elsewhere crosses NVLink, at about 400 GB/s a direction (an
  // H100's or H200's 450 less the protocol), whichever is slower. A GEMM-1 tile is 2 x tile_m x
  // tile_n x hidden flops at about 5 TFLOP/s per SM (an H100's bf16 rate shared by its SMs). The
  // other CTAs take the tiles that fit in the send's time.
  if (comm_ctas < 1 || rows <= 0 || hidden <= 0 || world_size < 1 || tile_m < 1 || tile_n < 1)
    return 0;
  double send_s = 4.0 * static_cast<double>(rows) * hidden / (comm_ctas * 60e9);
  const double remote = static_cast<double>(world_size - 1) / world_size;
  send_s = std::max(send_s, 2.0 * static_cast<double>(rows) * hidden * remote / 400e9);
  const double tile_s = 2.0 * tile_m * tile_n * hidden / 5e12;
  return static_cast<int>(std::ceil(send_s / tile_s));
}

int fused_default_tile_n(int tile_m, int64_t capacity, int64_t num_experts, int64_t ffn,
                         int sm_count) {
  if (tile_m < 0 || capacity < 0 || num_experts < 0 || ffn < 0 || sm_count < 0) return 256;
  return fused_auto_tile_n(tile_m, capacity, num_experts, ffn, sm_count);
}

Status fused_row_entries(const int64_t* gemm_row, int64_t entries, int64_t capacity,
                         int64_t* row_entry, cudaStream_t stream) {
  if (entries < 0 || capacity < 0)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("entries and capacity must be >= 0, got ", entries, " and ", capacity)};
  if (capacity == 0) return Status::Ok();
  if (row_entry == nullptr || (entries > 0 && gemm_row == nullptr))
    return {StatusCode::kInvalidArgument, "gemm_row and row_entry must be device pointers"};
  if (cudaMemsetAsync(row_entry, 0xff, capacity * sizeof(int64_t), stream) != cudaSuccess)
    return launch_status("fused_row_entries (fill)");
  if (entries == 0) return Status::Ok();
  const int blocks = static_cast<int>(std::min<int64_t>((entries + 255) / 256, 1024));
  megakernel::fused_row_entries_kernel<<<blocks, 256, 0, stream>>>(gemm_row, entries, capacity,
                                                                   row_entry);
  return launch_status("fused_row_entries");
}

// The problem arrays, the GEMM body's workspace, and last the reduce's ticket (its own 256 bytes).
size_t fused_moe_workspace_bytes(int64_t num_experts, int sm_count) {
  if (num_experts < 1 || num_experts > (1 << 20) || sm_count < 1) return 0;
  return grouped::group_arrays_bytes(2 * num_experts) +
         grouped::round_up(megakernel::gemm_workspace(num_experts, sm_count)) +
         megakernel::fused_held_bytes(sm_count) + grouped::kWorkspaceAlign;
}

namespace megakernel {
namespace {

// Both entries below: with `plan` the routing is planned in the launch that readies the
// problem arrays (fused_plan_problems), else by the caller before (fused_problems).
Status fused_forward(const FusedMoeArgs& a, const FusedLocalPlan* plan,
                     const FusedMoeLaunch& launch, int device, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream) {
  if (launch.tile_m != 128 && launch.tile_m != 64)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("tile_m must be 128 (cooperative 128 x 256 tiles) or 64 (ping-pong "
                            "64 x 256 or 64 x 128 tiles), got ",
                            launch.tile_m)};
  int sm_count = 0;
  if (Status s = megakernel::launch_sm_count(device, launch.sm_count, "the fused MoE kernel",
                                             "moe_fused_forward_bf16", sm_count);
      !s.ok())
    return s;
  // w1 as stored with an FFN of an odd number of 64s fits the 128-wide tiles only (a 256-wide
  // one reads 128 gate and 128 up columns): the width rule then leaves out its round check.
  const int64_t rule_ffn = a.w1_as_stored && a.ffn % 128 != 0 ? 0 : a.ffn;
  const int tile_n = launch.tile_n != 0 ? launch.tile_n
                                        : fused_default_tile_n(launch.tile_m, a.capacity,
                                                               a.num_experts, rule_ffn, sm_count);
  const megakernel::FusedEntry* entry =
      megakernel::find_entry(launch.tile_m, tile_n, a.w1_as_stored);
  if (entry == nullptr)
    return {StatusCode::kInvalidArgument,
            detail::str_cat("tile_n must be 0 (auto), 256, or with tile_m 64 also 128; got tile_n ",
                            launch.tile_n, " with tile_m ", launch.tile_m)};
  if (Status s = megakernel::check_args(a, launch.tile_m, tile_n); !s.ok()) return s;
  if (launch.comm_ctas < 1)
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat("comm_ctas must be >= 1 (someone sends the rows), got ", launch.comm_ctas)};
  if (launch.skip_rounds < -1 || launch.skip_rounds > (1 << 20))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("skip_rounds must be -1 (model) or in [0, 2^20], got ",
                            launch.skip_rounds)};
  if (launch.comm_ctas < sm_count &&
      (a.peers.world_size == 1 ? a.row_entry : a.send_order) == nullptr)
    return {StatusCode::kInvalidArgument,
            "moe_fused_forward_bf16: row_entry (world 1) or send_order (with peers) must be a "
            "device pointer when fewer CTAs than SMs send (they send in GEMM order)"};
  if (a.zero_state && a.peers.world_size > 1)
    return {StatusCode::kInvalidArgument,
            "zero_state is for world 1 only: across ranks peers store into the counters before "
            "this rank's call, so the caller zeroes them"};
  // A rank with no tokens of its own still computes the rows its peers send it.
  if (a.tokens == 0 && a.peers.world_size == 1) {
    if (!a.zero_state) return Status::Ok();
    if (cudaMemsetAsync(a.error, 0, sizeof(*a.error), stream) != cudaSuccess ||
        cudaMemsetAsync(a.timeout, 0, sizeof(*a.timeout), stream) != cudaSuccess)
      return launch_status("moe_fused_forward_bf16 (zeroing error and timeout)");
    return Status::Ok();
  }
  const size_t need = fused_moe_workspace_bytes(a.num_experts, sm_count);
  if (Status s = grouped::check_workspace(workspace, workspace_bytes, need, "the fused MoE kernel");
      !s.ok())
    return s;

  const grouped::Workspace ws = grouped::carve(workspace, 2 * a.num_experts);
  // The workspace's end: the held signals' slots, then the reduce's ticket.
  megakernel::FusedScratch scratch;
  char* end = static_cast<char*>(workspace) + need - grouped::kWorkspaceAlign;
  scratch.reduce_ticket = reinterpret_cast<uint32_t*>(end);
  scratch.held = reinterpret_cast<uint32_t**>(end - megakernel::fused_held_bytes(sm_count));
  scratch.num_held = static_cast<int64_t>(sm_count) * megakernel::kFusedConsumerWarps;
  megakernel::FusedZeroState zero;
  int problem_blocks = 1;
  if (a.zero_state) {
    zero.counters[0] = a.counters;
    zero.counters[1] = a.done1;
    zero.counters[2] = a.done2;
    zero.num_counters = a.num_counters;
    zero.error = a.error;
    zero.timeout = a.timeout;
    // A block per 8 stores a thread: a few blocks at the loads measured (hundreds of counters).
    const int64_t per_block = int64_t{megakernel::kProblemThreads} * 8;
    problem_blocks = static_cast<int>(std::min<int64_t>(
        sm_count, std::max<int64_t>(1, (a.num_counters + per_block - 1) / per_block)));
  }
  // A programmatic dependent launch, as the MegaKernel's behind it: each starts while the
  // kernel ahead of it runs and waits for its end in-kernel (wait_for_prior_grid), so that the
  // launch latencies of a decode step's three launches (the plan, this kernel, the MegaKernel)
  // overlap instead of adding up (a one-token call replayed 1-3% faster on bench_decode's two
  // loads, one H200, 2026-12-02). The bits cannot change: every read of a kernel ahead's output
  // comes after its wait.
  // With peers GEMM 2's rows go to the combine slots; its output pointers are not written.
  auto* y_rows = static_cast<grouped::Bf16*>(a.y != nullptr ? a.y : a.act);
  // A failed launch leaves its error for the launch_status below.
  if (plan != nullptr) {
    if (launch.comm_ctas < sm_count)
      return {StatusCode::kInvalidArgument,
              detail::str_cat("moe_fused_forward_planned_bf16: comm_ctas must be >= the grid (",
                              sm_count,
                              "): every CTA sends, token by token (the row-order send of fewer "
                              "CTAs needs the plan's row inverse first); got ",
                              launch.comm_ctas)};
    // A plain launch: it reads the routing, which the kernel ahead may write, at once.
    megakernel::fused_plan_problems<<<1, local_plan::kThreads, 0, stream>>>(
        *plan, a.tokens * a.top_k, static_cast<int>(a.num_experts), launch.tile_m,
        static_cast<int>(a.hidden), static_cast<int>(a.ffn),
        static_cast<const grouped::Bf16*>(a.rows), static_cast<const grouped::Bf16*>(a.w1_packed),
        static_cast<const grouped::Bf16*>(a.w2), static_cast<grouped::Bf16*>(a.act), y_rows, ws,
        scratch, zero);
  } else {
    (void)launch_after_prior(
        megakernel::fused_problems, dim3(static_cast<unsigned>(problem_blocks)),
        dim3(megakernel::kProblemThreads), 0, stream, a.offs, static_cast<int>(a.num_experts),
        static_cast<int>(a.capacity), static_cast<int>(a.hidden), static_cast<int>(a.ffn),
        static_cast<const grouped::Bf16*>(a.rows), static_cast<const grouped::Bf16*>(a.w1_packed),
        static_cast<const grouped::Bf16*>(a.w2), static_cast<grouped::Bf16*>(a.act), y_rows, ws,
        scratch, zero);
  }
  if (Status s = launch_status("the fused MoE kernel's problem kernel"); !s.ok()) return s;

  // Units of the cluster's CTAs.
  const int comm_units =
      (std::min(launch.comm_ctas, sm_count) + entry->cluster_m - 1) / entry->cluster_m;
  // The rows this rank sends: with peers, its entries (the capacity is what it may receive).
  const int64_t sent = a.peers.world_size > 1 ? a.tokens * a.top_k : a.capacity;
  const int skip = launch.skip_rounds >= 0
                       ? launch.skip_rounds
                       : fused_default_skip_rounds(sent, a.hidden, comm_units * entry->cluster_m,
                                                   a.peers.world_size, launch.tile_m, tile_n);
  return entry->launch(ws, a, comm_units, skip, scratch, device, sm_count, stream);
}

}  // namespace
}  // namespace megakernel

Status moe_fused_forward_bf16(const FusedMoeArgs& a, const FusedMoeLaunch& launch, int device,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  return megakernel::fused_forward(a, nullptr, launch, device, workspace, workspace_bytes, stream);
}

Status moe_fused_forward_planned_bf16(FusedMoeArgs a, const FusedLocalPlan& plan,
                                      const FusedMoeLaunch& launch, int device, void* workspace,
                                      size_t workspace_bytes, cudaStream_t stream) {
  constexpr const char* kWhat = "moe_fused_forward_planned_bf16";
  if (a.gemm_row != nullptr || a.counter != nullptr || a.offs != nullptr ||
      a.tile_base != nullptr || a.row_entry != nullptr || a.send_order != nullptr)
    return {StatusCode::kInvalidArgument,
            detail::str_cat(kWhat,
                            ": gemm_row, counter, offs, tile_base, row_entry and send_order of "
                            "FusedMoeArgs must be null (the launch plans the rows into plan's)")};
  if (a.peers.world_size != 1)
    return {StatusCode::kInvalidArgument,
            detail::str_cat(kWhat, ": the planned launch is for world 1 (peers.world_size 1), got ",
                            a.peers.world_size)};
  const int64_t entries = a.tokens * a.top_k;
  if (a.tokens > 0 && !fused_plan_fits(entries, a.num_experts))
    return {
        StatusCode::kInvalidArgument,
        detail::str_cat(kWhat, ": at most ", kFusedPlanMaxEntries, " entries (tokens x top_k) and ",
                        kFusedPlanMaxExperts, " experts (one block plans them), got ", entries,
                        " and ", a.num_experts, ": plan with plan_local_rows_async instead")};
  if (plan.topk_idx == nullptr || plan.gemm_row == nullptr || plan.counter == nullptr ||
      plan.offs == nullptr || plan.tile_base == nullptr)
    return {StatusCode::kInvalidArgument,
            detail::str_cat(kWhat,
                            ": plan.topk_idx, gemm_row, counter, offs and tile_base must be "
                            "device pointers")};
  a.gemm_row = plan.gemm_row;
  a.counter = plan.counter;
  a.offs = plan.offs;
  a.tile_base = plan.tile_base;
  a.zero_state = true;
  return megakernel::fused_forward(a, &plan, launch, device, workspace, workspace_bytes, stream);
}

}  // namespace uniep::cuda
