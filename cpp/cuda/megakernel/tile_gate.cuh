// The device side of a tile gate (include/uniep/cuda/tile_gate.hpp): the bounded wait a GEMM's
// producer makes before it loads a tile's rows, and the signal the writers of those rows give.
#pragma once

#include <cstdint>
#include "cuda/common/cta_index.cuh"
#include "cuda/common/device_wait.cuh"

#include "uniep/cuda/tile_gate.hpp"

namespace uniep::cuda::megakernel {

__device__ __forceinline__ uint32_t load_acquire_u32(const uint32_t* p) {
  uint32_t v;
  // System scope: the rows may have been stored by a peer GPU through an NVLink mapping.
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The rows were written by ordinary stores (generic proxy) and are about to be read by TMA (the
// async proxy): without this fence the TMA load may see the bytes from before the stores.
__device__ __forceinline__ void fence_generic_to_async() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Records the first failed wait (GateTimeout's flags); later ones are dropped.
__device__ __forceinline__ void gate_report(GateTimeout* t, uint32_t flag, int expert, int m_tile,
                                            uint32_t have, uint32_t need) {
  if (atomicCAS(&t->flag, 0u, flag) == 0u) {
    t->expert = expert;
    t->m_tile = m_tile;
    t->have = have;
    t->need = need;
    __threadfence_system();
  }
}

// True once any wait of the launch has given up (or the count exchange before it): the waits
// still spinning give up too, so a failed launch ends after one timeout, not one per tile.
__device__ __forceinline__ bool gate_failed(const GateTimeout* t) {
  return t != nullptr && *reinterpret_cast<const volatile uint32_t*>(&t->flag) != 0u;
}

// Whether the gate has anything to wait on (either kind).
__device__ __forceinline__ bool gate_active(const TileGate& g) {
  return g.counters != nullptr || g.ready != nullptr;
}

__device__ __forceinline__ uint32_t gate_load(const uint32_t* p) {
  return load_acquire_u32(p);
}
__device__ __forceinline__ uint64_t gate_load(const uint64_t* p) {
  return load_acquire_sys(p);
}

// The bounded spin of both kinds of gate: returns once *word >= need, or at the deadline after
// recording the first timeout (have / need as their low 32 bits), or once another wait of the
// launch gave up; the ns it waited go to the gate's waited_ns.
template <class Word>
__device__ __forceinline__ void gate_spin(const TileGate& g, const Word* word, Word need,
                                          int expert, int m_tile) {
  Word have = gate_load(word);
  if (have >= need) return;
  const uint64_t start = global_timer_ns();
  const uint64_t deadline = g.timeout_ns ? start + g.timeout_ns : ~0ull;
  while (have < need) {
    __nanosleep(64);
    if (global_timer_ns() > deadline) {
      gate_report(g.timeout, 1u, expert, m_tile, static_cast<uint32_t>(have),
                  static_cast<uint32_t>(need));
      break;
    }
    if (gate_failed(g.timeout)) break;
    have = gate_load(word);
  }
  if (g.waited_ns != nullptr) {
    atomicAdd(g.waited_ns + g.waited_stride * cta_linear_index(),
              static_cast<unsigned long long>(global_timer_ns() - start));
  }
}

// Called by one thread. Returns once tile (expert, m_tile) of an expert with `rows` rows may be
// loaded, or at the deadline after recording the first timeout; a tile with no counter among
// the gate's is recorded at once and never read. A tile past the expert's rows returns at once:
// the scheduler pads each expert's tiles to the cluster's M (2), and such a tile loads only
// out-of-bounds zeros, so it has no counter of its own (the index would be the next expert's).
__device__ __forceinline__ void gate_wait(const TileGate& g, int expert, int m_tile, int rows,
                                          int tile_m) {
  const int in_tile = min(tile_m, rows - m_tile * tile_m);
  if (in_tile <= 0) return;
  if (g.counters == nullptr) {
    // The word gate (TileGate::ready): every tile of the group waits for its word to reach the
    // epoch.
    if (g.ready[expert] != nullptr) gate_spin(g, g.ready[expert], g.epoch, expert, m_tile);
    return;
  }
  const uint32_t need = g.per_row * static_cast<uint32_t>(in_tile) + g.per_tile;
  const int64_t index = static_cast<int64_t>(g.tile_base[expert]) + m_tile;
  if (index < 0 || index >= g.num_counters) {
    gate_report(g.timeout, 2u, expert, m_tile, static_cast<uint32_t>(g.num_counters),
                static_cast<uint32_t>(index));
    return;
  }
  gate_spin(g, g.counters + index, need, expert, m_tile);
}

// The writer's side: everything this thread stored before the call is visible (at system scope)
// to whoever acquires the counter after seeing the increment.
__device__ __forceinline__ void gate_signal(uint32_t* counter, uint32_t add) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(counter), "r"(add) : "memory");
}

// The same for writers and waiters on one GPU (a GEMM's epilogue releasing the next GEMM's tiles
// or the reduce, the world-1 send): a release at GPU scope. Called by one lane after __syncwarp(),
// it also publishes the other lanes' stores (the warp barrier orders them before it, and a
// release is cumulative; CUTLASS's own arrive_inc relies on the same after a CTA barrier). Why
// not __threadfence_system() in every lane: that is a sequentially consistent fence at system
// scope (MEMBAR.SC.SYS), and once per warp per output tile it cost the gated GEMMs about 11% on
// an H100 (2026-11-26, commit 5660795).
__device__ __forceinline__ void gate_signal_gpu(uint32_t* counter, uint32_t add) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(add) : "memory");
}

// gate_signal where the waiter may be on a peer GPU (`system`), else gate_signal_gpu.
__device__ __forceinline__ void gate_signal_at(uint32_t* counter, uint32_t add, bool system) {
  if (system)
    gate_signal(counter, add);
  else
    gate_signal_gpu(counter, add);
}

}  // namespace uniep::cuda::megakernel
