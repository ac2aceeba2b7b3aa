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

// One runtime's symmetric allocation, the set-up every UniEP runtime shares: join the session
// (nvshmem_acquire, sized for this allocation), nvshmem_malloc, and on close nvshmem_free and
// nvshmem_release. nvshmem_malloc and nvshmem_free are collective: every rank of the group opens
// and closes its runtime's heap together (the runtimes are created and destroyed collectively,
// never from a static destructor).
class SymmetricHeap {
 public:
  SymmetricHeap() = default;
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;
  ~SymmetricHeap() { close(); }

  // Joins NVSHMEM over (world_size, rank), then allocates `bytes` on every rank. A failed
  // allocation is kCapacityExceeded: "nvshmem_malloc of <bytes> bytes<for_what> failed: <remedy>".
  Status open(const std::vector<uint8_t>& unique_id, int64_t world_size, int64_t rank, size_t bytes,
              const char* for_what, const char* remedy);

  // peers[p]: rank p's allocation as this rank reaches it (nvshmem_ptr), for every rank of the
  // group. kUnsupported when one is not reachable: "<needs> every rank of the group on this
  // rank's NVLink domain, but rank <p> is not reachable through nvshmem_ptr from rank <rank>;
  // <instead>".
  Status map_peers(uint8_t** peers, const char* needs, const char* instead) const;

  // Whether nvshmem_ptr reaches every rank's allocation (all on this rank's NVLink domain).
  bool all_peers_mapped() const;

  // Once this rank has zeroed the words its peers store into or wait on: waits for the device,
  // then for every rank (nvshmem_barrier_all), so that no peer touches them before they read
  // zero on every rank.
  Status barrier() const;

  // nvshmem_free (collective) and nvshmem_release; nothing where open did not get that far.
  void close();

  uint8_t* base() const { return base_; }
  // This open started NVSHMEM (rather than joining a running one).
  bool started() const { return started_; }

 private:
  uint8_t* base_ = nullptr;
  int64_t world_size_ = 0, rank_ = 0;
  bool joined_ = false, started_ = false;
};

}  // namespace uniep::runtime
