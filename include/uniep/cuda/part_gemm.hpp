// One persistent GEMM over the parts of a gathered operand, each part's tiles waiting for its
// rows: the GEMM of the CUDA all-gather + GEMM (uniep/cuda/collectives.hpp). Part i computes
//
//     out_i [rows, n] = a_i [rows, k] @ b [k, n]        (bf16, fp32 accumulation, row-major)
//
// and its tiles load a_i only once *ready_i >= epoch (ready_i null: at once). The parts are one
// grouped GEMM (the gated grouped GEMM's 128 x 256 x 64 tiles, tile_gate.hpp, or 128 x 128 ones
// where the wider tiles would leave much of the last wave idle: PartGemmProblem::tile_n) whose
// persistent tile scheduler takes them in the order given, so a caller lists first the parts that
// are there first (the own shard, then the peers' in the order they are sent). One launch replaces
// one GEMM per part: no wave is quantized per part, and no launch waits on the host's events.
//
// Bits: each output element is one fp32 dot product over k in ascending k-blocks, as in the
// grouped GEMM engine (grouped_gemm.hpp) and whatever the split into parts: the same bits as the
// GEMM of the whole gathered operand.
//
// The waits are bounded: past timeout_ns the first part that never arrived is recorded in
// *timeout (GateTimeout, flag 1: expert = the part, m_tile = its tile, have / need = the low 32
// bits of the word and the epoch) and the GEMM goes on with garbage, which the caller must not
// return. A word that only work on this GPU would set must have SMs to run on: the grid takes
// sm_count of them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "uniep/cuda/tile_gate.hpp"
#include "uniep/status.hpp"

namespace uniep::cuda {

struct GemmPart {
  const void* a = nullptr;          // [rows, k] bf16, device memory (a peer's mapping is fine)
  void* out = nullptr;              // [rows, n] bf16
  const uint64_t* ready = nullptr;  // device word, or null: no wait
};

struct PartGemmProblem {
  const GemmPart* parts = nullptr;  // host array of `count` parts, read during the call
  int64_t count = 0;
  int64_t rows = 0;         // of every part
  int64_t k = 0, n = 0;     // multiples of 8 (16-byte rows for TMA)
  const void* b = nullptr;  // [k, n] bf16, shared by every part
  // The order of each part's tiles (the bits do not depend on it): swizzle 0 (auto), 1, 2, 4
  // or 8; raster 'm' (every m-tile of a column of n-tiles, then the next), 'n', or 0 (auto).
  int swizzle = 0;
  char raster = 0;
  // The tiles' width: 256, 128 (only without `done`: its counters count 256-wide tiles), or 0
  // (auto: part_gemm_tile_n). The bits do not depend on it.
  int tile_n = 0;
  // Optional: where the parts' finished row blocks are announced, so that each part can be sent
  // on as soon as it is stored (the CUDA GEMM + reduce-scatter). part_gemm_row_tiles(rows)
  // counters a part, zeroed by the caller before the call: once a warp has stored its share of
  // m-tile t of part i it adds 1 (a release at system scope) to done[i * row tiles + t], which
  // is whole at part_gemm_tile_arrivals(n). The stores are then direct stores from the
  // accumulators instead of TMA's, with the same bits. Null: no signal.
  uint32_t* done = nullptr;
};

// Counters per part of PartGemmProblem::done, and what one of them reaches.
inline int64_t part_gemm_row_tiles(int64_t rows) {
  return (rows + kGatedTileM - 1) / kGatedTileM;
}
inline uint32_t part_gemm_tile_arrivals(int64_t n) {
  return static_cast<uint32_t>(kGatedWarpsPerTile * ((n + kGatedTileN - 1) / kGatedTileN));
}

// The tiles' width part_gemm_bf16 takes on `sm_count` SMs: p.tile_n where named; else 256 with
// `done`, else the plain GEMM's rule (gemm_sm90_auto_tile_n): 128 where its waves of clusters,
// at half the work a tile and taken as 0.9 as efficient, finish before the 256-wide tiles'.
int part_gemm_tile_n(const PartGemmProblem& p, int sm_count);

struct PartGate {
  uint64_t epoch = 0;
  uint64_t timeout_ns = 0;         // 0: wait forever (tests only)
  GateTimeout* timeout = nullptr;  // required where any part has a ready word
};

// Whether part_gemm_bf16 takes this problem: OK, or kInvalidArgument naming what it does not
// take (shapes, 16-byte alignment, the tile order, the counters' count). The gate is checked by
// the call.
Status part_gemm_supports(const PartGemmProblem& p);

// Bytes of workspace part_gemm_bf16 needs for `count` parts on `sm_count` SMs; 0 when count or
// sm_count is < 1.
size_t part_gemm_workspace_bytes(int64_t count, int sm_count);

// Enqueues the GEMM on `stream`: the parts' table written into the workspace (256-byte aligned;
// the stream's until the GEMM has run) by one small kernel per 128 parts, then the persistent
// launch. No host synchronization; capturable in a CUDA graph. kInvalidArgument names the
// argument; kUnsupported off Hopper.
Status part_gemm_bf16(const PartGemmProblem& p, const PartGate& gate, int device, int sm_count,
                      void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace uniep::cuda
