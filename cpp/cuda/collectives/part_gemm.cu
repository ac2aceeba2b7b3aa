// part_gemm_bf16 (include/uniep/cuda/part_gemm.hpp): the parts' table built on the host, copied
// into the workspace as the grouped kernel's problem arrays, then the gated grouped GEMM with
// the store epilogue, its gate the parts' ready words.
//
// Why a host table here when the expert GEMMs build theirs on the device: the parts' shapes and
// pointers are known to the host (every part has the same rows; the pointers are the caller's
// tensor and the symmetric slots), so nothing waits for the GPU. The table's pageable copy is
// staged by the driver before the call returns, so the host array may go right after.
#include <cuda_runtime.h>

#include <cstring>
#include <vector>

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

// The table's bytes: the problem arrays (grouped::carve's layout), then one ready pointer per part.
size_t table_bytes(int64_t count) {
  return grouped::group_arrays_bytes(count) +
         grouped::round_up(static_cast<size_t>(count) * sizeof(void*));
}

Status check(const PartGemmProblem& p, const PartGate& gate) {
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
  bool any_ready = false;
  for (int64_t i = 0; i < p.count; ++i) {
    const GemmPart& part = p.parts[i];
    if (part.a == nullptr || !aligned16(part.a) || part.out == nullptr || !aligned16(part.out))
      return bad("parts[", i, "]: a and out must be 16-byte aligned device pointers");
    any_ready = any_ready || part.ready != nullptr;
  }
  if (p.swizzle != 0 && p.swizzle != 1 && p.swizzle != 2 && p.swizzle != 4 && p.swizzle != 8)
    return bad("swizzle must be 0 (auto), 1, 2, 4 or 8, got ", p.swizzle);
  if (p.raster != 0 && p.raster != 'm' && p.raster != 'n')
    return bad("raster must be 'm', 'n' or 0 (auto), got ", static_cast<int>(p.raster));
  if (any_ready && gate.timeout == nullptr)
    return bad("gate.timeout must be a device pointer where a part has a ready word");
  return Status::Ok();
}

}  // namespace

size_t part_gemm_workspace_bytes(int64_t count, int sm_count) {
  if (count < 1 || count > kMaxParts || sm_count < 1) return 0;
  return table_bytes(count) + megakernel::gated_store_workspace(count, sm_count);
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

  // The table is laid out on the host exactly as it will lie in the workspace: carve() at the
  // workspace's address gives the device pointers the kernel reads, and at the same offsets in
  // the host image the values go.
  const size_t bytes = table_bytes(p.count);
  std::vector<unsigned char> image(bytes, 0);
  const grouped::Workspace dev = grouped::carve(workspace, p.count);
  auto* base = static_cast<unsigned char*>(workspace);
  auto at = [&](const void* device_ptr) {
    return image.data() + (static_cast<const unsigned char*>(device_ptr) - base);
  };
  const size_t arrays = grouped::group_arrays_bytes(p.count);
  auto* ready = reinterpret_cast<const uint64_t**>(image.data() + arrays);
  const int rows = static_cast<int>(p.rows), k = static_cast<int>(p.k), n = static_cast<int>(p.n);
  bool any_ready = false;
  for (int64_t i = 0; i < p.count; ++i) {
    const GemmPart& part = p.parts[i];
    const grouped::Shape shape{rows, n, k};
    const grouped::StrideD stride_d{p.n, cute::_1{}, cute::_0{}};
    std::memcpy(at(dev.shapes + i), &shape, sizeof(shape));
    std::memcpy(at(dev.ptr_a + i), &part.a, sizeof(void*));
    std::memcpy(at(dev.ptr_b + i), &p.b, sizeof(void*));
    std::memcpy(at(dev.ptr_d + i), &part.out, sizeof(void*));
    std::memcpy(at(dev.stride_a + i), &p.k, sizeof(int64_t));  // a rows: k apart
    std::memcpy(at(dev.stride_b + i), &p.n, sizeof(int64_t));  // b [k, n]: rows n apart
    std::memcpy(at(dev.stride_d + i), &stride_d, sizeof(stride_d));
    ready[i] = part.ready;
    any_ready = any_ready || part.ready != nullptr;
  }
  if (cudaError_t e =
          cudaMemcpyAsync(workspace, image.data(), bytes, cudaMemcpyHostToDevice, stream);
      e != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("the part GEMM's table copy failed: ", cudaGetErrorString(e))};

  grouped::Workspace ws = dev;
  ws.gemm = base + bytes;  // CUTLASS's own workspace after the table
  TileGate g;              // no part waits: no gate, and no load of a word per tile
  if (any_ready) g.ready = reinterpret_cast<const uint64_t* const*>(base + arrays);
  g.epoch = gate.epoch;
  g.timeout_ns = gate.timeout_ns;
  g.timeout = gate.timeout;
  megakernel::GatedOrder order;
  order.swizzle = p.swizzle > 0 ? p.swizzle : 1;
  // auto: along the longer side of a part's tiles, as CUTLASS's heuristic for one GEMM.
  const int64_t tiles_m = (p.rows + kGatedTileM - 1) / kGatedTileM;
  const int64_t tiles_n = (p.n + kGatedTileN - 1) / kGatedTileN;
  order.along_n = p.raster == 'n' || (p.raster == 0 && tiles_n > tiles_m);
  return megakernel::gated_store_run(ws, p.count, g, device, sm_count, stream, order);
}

}  // namespace uniep::cuda
