// UniEP's own Hopper GEMM (CUTLASS 3, TMA warp-specialized, persistent): what the collectives
// need from a GEMM that cuBLAS does not give them through torch:
//  - an addend with its own pointer, D = A @ B + C with C != D, so a reduce-scatter folds the
//    peers' partials in the GEMM's epilogue instead of in a kernel after the last GEMM;
//  - the number of SMs the persistent grid takes, so copies and folds queued beside the GEMM get
//    SMs of their own instead of waiting for its last wave.
// Row-major bf16 operands, fp32 accumulation, Hopper (sm_90a) only; callers fall back to
// cuBLAS where gemm_sm90_supports() says no. Each output element's K loop is the same whatever
// the tile, grid or row range, so its bits depend on none of them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "uniep/status.hpp"

namespace uniep::cuda {

// D[m, n] = A[m, k] @ B[k, n] (+ C[m, n]); row-major, leading dimensions in elements.
struct GemmOperands {
  const void* a = nullptr;
  const void* b = nullptr;
  const void* c = nullptr;  // optional addend; may not alias d
  void* d = nullptr;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0, ldd = 0;
};

// How the kernel tiles and orders its work; 0 / kAuto: chosen from the shape and the SM count.
enum class GemmRaster { kAuto, kAlongM, kAlongN };
struct GemmTuning {
  int tile_n = 0;   // output tile 128 x tile_n: 128 or 256
  int swizzle = 0;  // tiles a cluster row visits before the next: 1, 2, 4 or 8
  GemmRaster raster = GemmRaster::kAuto;

  Status validate() const;
};

// The tile width the kernel uses for `op` on `sm_count` SMs when tuning.tile_n is 0: the one
// whose whole waves of tiles take the least time (a 128-wide tile does about 90% of the work per
// SM-second of a 256-wide one, but half-empty last waves cost more).
int gemm_sm90_auto_tile_n(const GemmOperands& op, int sm_count);

// That rule on `cluster_rows` rows of clusters (two 128-row tiles along M each) of an output `n`
// wide: 128 or 256. The part GEMM's gated tiles take it too (part_gemm_tile_n), whose parts pair
// their m-tiles each on their own.
int auto_tile_n_for_cluster_rows(int64_t cluster_rows, int64_t n, int sm_count);

// Whether `device` can run the kernel (compute capability 9.0: it is built for sm_90a only).
bool gemm_sm90_device_ok(int device);

// OK when the kernel takes these operands; else kUnsupported naming what it lacks (alignment of
// 16 bytes for pointers and leading dimensions, 32-bit extents), so the caller can fall back.
Status gemm_sm90_supports(const GemmOperands& op);

// Bytes of device workspace gemm_sm90_bf16 needs for these operands on `sm_count` SMs; 0 for
// operands, tuning or SM counts it refuses.
size_t gemm_sm90_workspace_bytes(const GemmOperands& op, const GemmTuning& tuning, int sm_count);

// Enqueues the GEMM on `stream`, its persistent grid on at most `sm_count` SMs of `device`.
Status gemm_sm90_bf16(const GemmOperands& op, const GemmTuning& tuning, int device, int sm_count,
                      void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace uniep::cuda
