// Grouped-GEMM rows of the local experts: each expert's rows are the receive slots that chose it,
// in slot order (= (source rank, source token) order), one row per matching top-k entry in k
// order. Each row also records where its output goes back to: slot (token, k) on its source rank.
//
// Three short kernels over warp units of kSlotsPerUnit slots. One block per expert scanning every
// slot (El x N x K compares, 29 us of the EP2 DeepSeek-V3 round) was replaced so the work is
// N x K, done once:
//  1. count: each unit counts its entries per local expert;
//  2. scan: per expert, an exclusive sum over units gives each unit's first row of that expert;
//  3. assign: each unit walks its (slot, k) entries in that order, 32 at a time, and ranks
//     equal experts among the lanes with __match_any_sync; a per-expert cursor in shared memory
//     carries the rank from one group of 32 to the next.
// Every row index is a function of the metadata alone, so the lists are identical run to run.
#include <algorithm>
#include <cstdint>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kSlotsPerUnit = 32;  // one warp; a unit's entries are kSlotsPerUnit * K
constexpr int kMaxWarps = 8;       // units per block of the count and assign kernels
constexpr int kScanItems = 8;      // units each lane of the scan sums before the warp scan
constexpr int kPrefetch = 8;       // groups of 32 entries whose ids are loaded before any is used
constexpr size_t kSharedBytes = 48 * 1024;

__device__ __forceinline__ int64_t units_of(int64_t slots) {
  return (slots + kSlotsPerUnit - 1) / kSlotsPerUnit;
}

// Entry x of a unit (x = slot_in_unit * K + k): its local expert, or -1 where the entry is past
// the last slot or names another rank's expert (or none); for a local one, where its output goes.
struct Entry {
  int64_t slot;
  int64_t target;
  int64_t end;  // of its expert's rows
  int local;
};

// kPrefetch groups of 32 entries from entry x0 on. Each step's loads are independent of each
// other, so they are in flight together: one latency for the ids, one for the tokens and the ends
// of the experts' rows (a loop or a branch per entry around the loads kept them one at a time:
// 9 us at EP2).
__device__ __forceinline__ void load_entries(const ExpertRowsArgs& a, int64_t first_slot,
                                             int64_t x0, int lane, Entry (&en)[kPrefetch]) {
  const int64_t K = a.top_k, entries = kSlotsPerUnit * K;
  int64_t k[kPrefetch], id[kPrefetch], token[kPrefetch];
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int64_t x = x0 + i * 32 + lane;
    en[i].slot = first_slot + x / K;
    k[i] = x % K;
    const bool in = x < entries && en[i].slot < a.slots;
    id[i] = in ? a.ids[en[i].slot * a.ids_stride + k[i]] : -1;
  }
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    const int64_t g = id[i] - a.first_expert;
    en[i].local = id[i] >= 0 && g >= 0 && g < a.experts_per_rank ? static_cast<int>(g) : -1;
    token[i] = en[i].local >= 0 ? a.token[en[i].slot * a.token_stride] : 0;
    en[i].end = en[i].local >= 0 ? a.expert_offsets[en[i].local + 1] : 0;
  }
#pragma unroll
  for (int i = 0; i < kPrefetch; ++i) {
    // recv_offsets: W + 1 words every warp reads, so from the cache.
    int64_t src = 0;
    while (src + 1 < a.world_size && en[i].slot >= a.recv_offsets[src + 1]) ++src;
    en[i].target = (src * a.max_tokens + token[i]) * K + k[i];
  }
}

__global__ void expert_rows_count_kernel(ExpertRowsArgs a) {
  extern __shared__ int64_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t El = a.experts_per_rank, units = units_of(a.slots);
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  int* count = reinterpret_cast<int*>(smem) + warp * El;
  for (int64_t e = lane; e < El; e += 32) count[e] = 0;
  __syncwarp();
  if (unit >= units) return;
  const int64_t slot = unit * kSlotsPerUnit + lane;
  if (slot < a.slots) {
    for (int64_t k = 0; k < a.top_k; ++k) {
      const int64_t g = a.ids[slot * a.ids_stride + k] - a.first_expert;
      if (g >= 0 && g < El) atomicAdd(&count[g], 1);
    }
  }
  __syncwarp();
  for (int64_t e = lane; e < El; e += 32) a.unit_rows[e * units + unit] = count[e];
}

// One warp per local expert: unit_rows[e][u] becomes the expert's first row in unit u. The
// expert's total must be what its senders announced (expert_offsets, from the count exchange),
// or a peer's metadata is corrupt: the assign kernel then keeps to the expert's rows, and the
// error reaches the host.
__global__ void expert_rows_scan_kernel(ExpertRowsArgs a) {
  const int lane = threadIdx.x % 32;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (e >= a.experts_per_rank) return;
  const int64_t units = units_of(a.slots);
  int64_t* rows = a.unit_rows + e * units;
  int64_t carry = a.expert_offsets[e];
  for (int64_t u0 = 0; u0 < units; u0 += 32 * kScanItems) {
    int64_t v[kScanItems];
    int64_t sum = 0;
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const int64_t u = u0 + lane * kScanItems + i;
      v[i] = u < units ? rows[u] : 0;
      sum += v[i];
    }
    int64_t inclusive = sum;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    int64_t row = carry + inclusive - sum;
#pragma unroll
    for (int i = 0; i < kScanItems; ++i) {
      const int64_t u = u0 + lane * kScanItems + i;
      if (u < units) rows[u] = row;
      row += v[i];
    }
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  const int64_t want = a.expert_offsets[e + 1];
  if (lane == 0 && carry != want && a.err != nullptr)
    report_error(a.err, WaitOp::kExpertRows, static_cast<int>(e), carry - a.expert_offsets[e],
                 want - a.expert_offsets[e]);
}

__global__ void expert_rows_assign_kernel(ExpertRowsArgs a) {
  extern __shared__ int64_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t El = a.experts_per_rank, K = a.top_k, units = units_of(a.slots);
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + warp;
  if (unit >= units) return;
  const int64_t first_slot = unit * kSlotsPerUnit, entries = kSlotsPerUnit * K;
  Entry en[kPrefetch];
  load_entries(a, first_slot, 0, lane, en);  // issued before the cursors' loads
  int64_t* cursor = smem + warp * El;
  for (int64_t e = lane; e < El; e += 32) cursor[e] = a.unit_rows[e * units + unit];
  __syncwarp();
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t x0 = 0; x0 < entries; x0 += 32 * kPrefetch) {
    if (x0 > 0) load_entries(a, first_slot, x0, lane, en);
#pragma unroll
    for (int i = 0; i < kPrefetch; ++i) {
      if (x0 + i * 32 >= entries) break;  // uniform across the warp
      const unsigned same = __match_any_sync(0xffffffffu, en[i].local);
      int64_t row = -1;
      if (en[i].local >= 0) row = cursor[en[i].local] + __popc(same & lower);
      __syncwarp();
      if (en[i].local >= 0) {
        // The lowest lane of each expert advances its cursor past the group's rows.
        if ((same & lower) == 0) cursor[en[i].local] += __popc(same);
        if (row < en[i].end) {
          a.row_slot[row] = en[i].slot;
          a.row_target[row] = en[i].target;
        }
      }
      __syncwarp();
    }
  }
}

int warps_per_block(int64_t experts_per_rank) {
  const int64_t fit = static_cast<int64_t>(kSharedBytes / sizeof(int64_t)) / experts_per_rank;
  return static_cast<int>(fit < 1 ? 1 : fit > kMaxWarps ? kMaxWarps : fit);
}

}  // namespace

size_t expert_rows_scratch_bytes(int64_t slots, int64_t experts_per_rank) {
  return sizeof(int64_t) * static_cast<size_t>(experts_per_rank) *
         static_cast<size_t>((slots + kSlotsPerUnit - 1) / kSlotsPerUnit);
}

int64_t expert_rows_max_experts() {
  return static_cast<int64_t>(kSharedBytes / sizeof(int64_t));
}

namespace {

struct UnitGrid {
  unsigned blocks;
  int threads;
  size_t shared;
};

UnitGrid unit_grid(const ExpertRowsArgs& a) {
  const int64_t units = (a.slots + kSlotsPerUnit - 1) / kSlotsPerUnit;
  const int warps = warps_per_block(a.experts_per_rank);
  return {static_cast<unsigned>((units + warps - 1) / warps), warps * 32,
          sizeof(int64_t) * static_cast<size_t>(warps * a.experts_per_rank)};
}

}  // namespace

void launch_expert_rows_count(const ExpertRowsArgs& a, cudaStream_t stream) {
  if (a.slots <= 0 || a.experts_per_rank <= 0) return;
  const UnitGrid g = unit_grid(a);
  expert_rows_count_kernel<<<g.blocks, g.threads, g.shared, stream>>>(a);
}

void launch_expert_rows_place(const ExpertRowsArgs& a, cudaStream_t stream) {
  if (a.slots <= 0 || a.experts_per_rank <= 0) return;
  const UnitGrid g = unit_grid(a);
  const auto scan_blocks = static_cast<unsigned>((a.experts_per_rank + kMaxWarps - 1) / kMaxWarps);
  expert_rows_scan_kernel<<<scan_blocks, kMaxWarps * 32, 0, stream>>>(a);
  expert_rows_assign_kernel<<<g.blocks, g.threads, g.shared, stream>>>(a);
}

void launch_expert_rows(const ExpertRowsArgs& a, cudaStream_t stream) {
  launch_expert_rows_count(a, stream);
  launch_expert_rows_place(a, stream);
}

namespace {

__global__ void row_weights_kernel(const float* __restrict__ slot_weights,
                                   const int64_t* __restrict__ row_slot,
                                   const int64_t* __restrict__ row_target, int64_t rows,
                                   int64_t top_k, float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += stride)
    out[r] = slot_weights[row_slot[r] * top_k + row_target[r] % top_k];
}

}  // namespace

void launch_row_weights(const float* slot_weights, const int64_t* row_slot,
                        const int64_t* row_target, int64_t rows, int64_t top_k, float* out,
                        cudaStream_t stream) {
  if (rows <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((rows + kThreads - 1) / kThreads, 4096);
  row_weights_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      slot_weights, row_slot, row_target, rows, top_k, out);
}

}  // namespace uniep::cuda
