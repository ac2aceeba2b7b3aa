// One NVSHMEM initialisation per process, shared by every UniEP runtime (expert-parallel and
// collectives, any number of groups over the same ranks) and reference-counted.
//
// NVSHMEM stays initialised when the last runtime goes: re-created runtimes (a runtime grown for
// a larger batch is destroyed and created again) join the running one. Finalising and starting
// NVSHMEM again in one process left state behind that crashed the process at exit (SIGSEGV after
// all its output, seen with a runtime grown once on an H200), and a process that exits with
// NVSHMEM running exits cleanly: the driver releases its memory and peer mappings. Only a later
// runtime over other ranks (another world size or rank) finalises the idle session and starts a
// new one, since NVSHMEM spans one set of PEs; that restart may still meet the crash at exit, and
// only a program that moves its runtimes to another group takes it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "uniep/status.hpp"

namespace uniep::runtime {

// Joins NVSHMEM over (world_size, rank). If nobody in the process started it, starts it from
// rank 0's unique id, sizing the symmetric heap to heap_bytes plus a reserve unless the user set
// NVSHMEM_SYMMETRIC_SIZE. If someone did (torch symmetric memory, another runtime), reuses it
// when it spans the same ranks and fails with the facts otherwise. *started: this call started it.
Status nvshmem_acquire(const std::vector<uint8_t>& unique_id, int64_t world_size, int64_t rank,
                       size_t heap_bytes, bool* started);

// Pairs with a successful nvshmem_acquire. Never finalises (see above), so it is not collective;
// the nvshmem_free before it is.
void nvshmem_release();

}  // namespace uniep::runtime
