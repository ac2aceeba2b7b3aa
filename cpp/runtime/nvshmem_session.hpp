// One NVSHMEM initialisation per process, shared by every UniEP runtime (expert-parallel and
// collectives, any number of groups over the same ranks) and reference-counted: the last runtime
// out finalises NVSHMEM, and only if UniEP started it.
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

// Pairs with a successful nvshmem_acquire; collective (finalisation is), so every rank of the
// group releases together.
void nvshmem_release();

}  // namespace uniep::runtime
