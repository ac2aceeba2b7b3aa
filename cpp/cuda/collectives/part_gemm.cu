// part_gemm_bf16 (include/uniep/cuda/part_gemm.hpp): the parts' table written into the workspace
// as the grouped kernel's problem arrays, then the gated grouped GEMM with the store epilogue,
// its gate the parts' ready words. The host knows every part's shape and pointers (the caller's
// tensor, the symmetric slots), so unlike the expert GEMMs nothing here waits for the GPU.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/gemm/gemm.hpp"
#include "cuda/gemm/grouped/grouped_types.hpp"
#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "cuda/megakernel/gated_run.cuh"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/cuda/part_gemm.hpp"

namespace uniep::cuda {
namespace {

constexpr int64_t kMaxParts = 1 << 20;
constexpr int64_t kMaxExtent = (1ll << 31) - 1;

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The table's bytes: the problem arrays (grouped::carve's layout), then one ready pointer per
// part, then each part's first done counter (GatedSignal::done_base).
size_t ready_offset(int64_t count) {
  return grouped::group_arrays_bytes(count);
}
size_t done_base_offset(int64_t count) {
  return ready_offset(count) + grouped::round_up(static_cast<size_t>(count) * sizeof(void*));
}
size_t table_bytes(int64_t count) {
  return done_base_offset(count) + grouped::round_up(static_cast<size_t>(count) * sizeof(int32_t));
}

}  // namespace

Status part_gemm_supports(const PartGemmProblem& p) {
  auto bad = [](auto&&... what) {
    return Status{StatusCode::kInvalidArgument, detail::str_cat(what...)};
  };
  if (p.count < 1 || p.count > kMaxParts)
    return bad("count must be in [1, ", kMaxParts, "], got ", p.count);
  if (p.parts == nullptr) return bad("parts must be a host array of count parts, got null");
  if (p.rows < 1 || p.rows > kMaxExtent) return bad("rows must be in [1, 2^31), got ", p.rows);
  if (p.k < 1 || p.k > kMaxExtent || p.k % grouped::kAlign != 0)
    return bad("k must be a positive multiple of ", grouped::kAlign,
               " (the GEMM's TMA moves 16-byte rows), got ", p.k);
  if (p.n < 1 || p.n > kMaxExtent || p.n % grouped::kAlign != 0)
    return bad("n must be a positive multiple of ", grouped::kAlign,
               " (the GEMM's TMA moves 16-byte rows), got ", p.n);
  if (p.b == nullptr || !aligned16(p.b)) return bad("b must be a 16-byte aligned device pointer");
  for (int64_t i = 0; i < p.count; ++i) {
    const GemmPart& part = p.parts[i];
    if (part.a == nullptr || !aligned16(part.a) || part.out == nullptr || !aligned16(part.out))
      return bad("parts[", i, "]: a and out must be 16-byte aligned device pointers");
  }
  if (p.swizzle != 0 && p.swizzle != 1 && p.swizzle != 2 && p.swizzle != 4 && p.swizzle != 8)
    return bad("swizzle must be 0 (auto), 1, 2, 4 or 8, got ", p.swizzle);
  if (p.raster != 0 && p.raster != 'm' && p.raster != 'n')
    return bad("raster must be 'm', 'n' or 0 (auto), got ", static_cast<int>(p.raster));
  if (p.tile_n != 0 && p.tile_n != 128 && p.tile_n != kGatedTileN)
    return bad("tile_n must be 0 (auto), 128 or ", kGatedTileN, ", got ", p.tile_n);
  if (p.tile_n == 128 && p.done != nullptr)
    return bad("tile_n 128 takes no done counters (they count ", kGatedTileN, "-wide tiles)");
  if (p.done != nullptr && p.count * part_gemm_row_tiles(p.rows) > kMaxExtent)
    return bad("done: count x row tiles (", p.count * part_gemm_row_tiles(p.rows),
               ") counters must number fewer than 2^31");
  return Status::Ok();
}

int part_gemm_tile_n(const PartGemmProblem& p, int sm_count) {
  if (p.tile_n != 0) return p.tile_n;
  if (p.done != nullptr) return kGatedTileN;
  static_assert(kGatedTileN == 256, "the wave rule weighs 128- against 256-wide tiles");
  // Clusters of two tiles along M, each part's m-tiles paired on their own.
  const int64_t cluster_rows = p.count * ((part_gemm_row_tiles(p.rows) + 1) / 2);
  return auto_tile_n_for_cluster_rows(cluster_rows, p.n, sm_count);
}

namespace {

Status check(const PartGemmProblem& p, const PartGate& gate) {
  if (Status s = part_gemm_supports(p); !s.ok()) return s;
  bool any_ready = false;
  for (int64_t i = 0; i < p.count; ++i) any_ready = any_ready || p.parts[i].ready != nullptr;
  if (any_ready && gate.timeout == nullptr)
    return {StatusCode::kInvalidArgument,
            "gate.timeout must be a device pointer where a part has a ready word"};
  return Status::Ok();
}

// The parts' table goes to the device as kernel parameters, kPartsPerLaunch parts a launch (3 KB,
// under the 4 KB every driver takes): no host copy to stage or keep alive, no sync, and the call
// stays capturable.
constexpr int kPartsPerLaunch = 128;

struct PartBatch {
  const void* a[kPartsPerLaunch];
  void* out[kPartsPerLaunch];
  const uint64_t* ready[kPartsPerLaunch];
  int first, count;
};

__global__ void __launch_bounds__(kPartsPerLaunch)
    write_parts(const PartBatch batch, grouped::Workspace ws, const uint64_t** ready,
                int32_t* done_base, int rows, int k, int n, const void* b) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= batch.count) return;
  const int g = batch.first + i;
  ws.shapes[g] = grouped::Shape{rows, n, k};
  ws.ptr_a[g] = static_cast<const grouped::Bf16*>(batch.a[i]);
  ws.ptr_b[g] = static_cast<const grouped::Bf16*>(b);
  ws.ptr_d[g] = static_cast<grouped::Bf16*>(batch.out[i]);
  ws.stride_a[g] = k;  // a rows: k apart
  ws.stride_b[g] = n;  // b [k, n]: rows n apart
  ws.stride_d[g] = grouped::StrideD{static_cast<int64_t>(n), cute::_1{}, cute::_0{}};
  ready[g] = batch.ready[i];
  done_base[g] = g * ((rows + kGatedTileM - 1) / kGatedTileM);
}

}  // namespace

size_t part_gemm_workspace_bytes(int64_t count, int sm_count) {
  if (count < 1 || count > kMaxParts || sm_count < 1) return 0;
  return table_bytes(count) + std::max({megakernel::gated_store_workspace(count, sm_count),
                                        megakernel::gated_store_n128_workspace(count, sm_count),
                                        megakernel::gated_store_signal_workspace(count, sm_count)});
}

Status part_gemm_bf16(const PartGemmProblem& p, const PartGate& gate, int device, int sm_count,
                      void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (Status s = check(p, gate); !s.ok()) return s;
  if (sm_count < 1)
    return {StatusCode::kInvalidArgument, detail::str_cat("sm_count must be >= 1, got ", sm_count)};
  if (!grouped_gemm_device_ok(device))
    return {StatusCode::kUnsupported,
            "the part GEMM needs a compute capability 9.0 GPU (sm_90a build)"};
  if (Status s =
          grouped::check_workspace(workspace, workspace_bytes,
                                   part_gemm_workspace_bytes(p.count, sm_count), "the part GEMM");
      !s.ok())
    return s;

  const size_t bytes = table_bytes(p.count);
  const grouped::Workspace dev = grouped::carve(workspace, p.count);
  auto* base = static_cast<unsigned char*>(workspace);
  const auto** ready = reinterpret_cast<const uint64_t**>(base + ready_offset(p.count));
  auto* done_base = reinterpret_cast<int32_t*>(base + done_base_offset(p.count));
  bool any_ready = false;
  for (int64_t first = 0; first < p.count; first += kPartsPerLaunch) {
    PartBatch batch{};
    batch.first = static_cast<int>(first);
    batch.count = static_cast<int>(std::min<int64_t>(kPartsPerLaunch, p.count - first));
    for (int i = 0; i < batch.count; ++i) {
      const GemmPart& part = p.parts[first + i];
      batch.a[i] = part.a;
      batch.out[i] = part.out;
      batch.ready[i] = part.ready;
      any_ready = any_ready || part.ready != nullptr;
    }
    write_parts<<<1, kPartsPerLaunch, 0, stream>>>(batch, dev, ready, done_base,
                                                   static_cast<int>(p.rows), static_cast<int>(p.k),
                                                   static_cast<int>(p.n), p.b);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
      return {StatusCode::kInternal,
              detail::str_cat("the part GEMM's table kernel failed: ", cudaGetErrorString(e))};
  }

  grouped::Workspace ws = dev;
  ws.gemm = base + bytes;  // CUTLASS's own workspace after the table
  TileGate g;              // no part waits: no gate, and no load of a word per tile
  if (any_ready) g.ready = ready;
  g.epoch = gate.epoch;
  g.timeout_ns = gate.timeout_ns;
  g.timeout = gate.timeout;
  // auto: along N in bands of 4 where a part has at most 8 m-tiles (few m-tiles share each
  // weight column), else along M. A provisional rule from a first development timing at world 1,
  // whose repeats spread as much as the orders differed; bench_gemm's part column is to settle
  // it.
  const int64_t tiles_m = part_gemm_row_tiles(p.rows);
  const bool along_n = p.raster == 'n' || (p.raster == 0 && tiles_m <= 8);
  megakernel::GatedOrder order;
  order.along_n = along_n;
  order.swizzle = p.swizzle > 0 ? p.swizzle : along_n ? 4 : 1;
  if (p.done == nullptr && part_gemm_tile_n(p, sm_count) == 128)
    return megakernel::gated_store_n128_run(ws, p.count, g, device, sm_count, stream, order);
  if (p.done == nullptr)
    return megakernel::gated_store_run(ws, p.count, g, device, sm_count, stream, order);
  GatedSignal signal;
  signal.done = p.done;
  signal.done_base = done_base;
  signal.num_done = p.count * part_gemm_row_tiles(p.rows);
  return megakernel::gated_store_signal_run(ws, p.count, g, signal, p.n, device, sm_count, stream,
                                            order);
}

}  // namespace uniep::cuda
