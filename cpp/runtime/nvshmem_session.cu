// The shared NVSHMEM initialisation and the runtimes' symmetric heaps (nvshmem_session.hpp).
#include <cuda_runtime_api.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "runtime/nvshmem_session.hpp"
#include "runtime/runtime_support.hpp"

namespace uniep::runtime {
namespace {
int g_holders = 0;
bool g_started = false;

// What nvshmemx_init_attr does, minus its exit(-1) on failure: initialise (or join) NVSHMEM
// through the device library linked into this module, which registers its device state with the
// host library.
Status init_through_our_device_library(unsigned int flags, nvshmemx_init_attr_t* attr) {
  if (attr != nullptr) nvshmemx_init_init_attr_ver_only((*attr));
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  int provided = 0;
  const int status =
      nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, flags, attr, version);
  if (status != 0)
    return {StatusCode::kInternal, detail::str_cat("NVSHMEM initialisation failed (status ", status,
                                                   "); NVSHMEM_DEBUG=WARN prints why")};
  return Status::Ok();
}
}  // namespace

Status nvshmem_acquire(const std::vector<uint8_t>& unique_id, int64_t world_size, int64_t rank,
                       size_t heap_bytes, bool* started) {
  *started = false;
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED && g_started && g_holders == 0 &&
      (nvshmem_n_pes() != world_size || nvshmem_my_pe() != rank)) {
    // Ours, idle, and over other ranks: the one case that finalises (the header says why this
    // is otherwise avoided). Every rank of the old session reaches it, since each creates its
    // runtime over the new group in the same call.
    nvshmem_finalize();
    g_started = false;
  }
  if (nvshmemx_init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) {
    if (nvshmem_n_pes() != world_size || nvshmem_my_pe() != rank) {
      return {StatusCode::kUnsupported,
              detail::str_cat("NVSHMEM is already initialised in this process with ",
                              nvshmem_n_pes(), " PEs (this PE ", nvshmem_my_pe(),
                              "), but the group has world_size ", world_size, " and rank ", rank,
                              "; UniEP can only share NVSHMEM over the same ranks")};
    }
    // Started by someone else (torch's symmetric memory, say), whose device library is not
    // ours: our module's copy of the device state (heap bases, peer mappings, which every
    // nvshmem_ptr and put in our kernels reads) is filled only once the host library knows it,
    // and only an init call through our device library tells it. The host library then skips
    // the bootstrap it already did and writes the running state into our copy.
    if (!g_started && g_holders == 0) {
      if (Status s = init_through_our_device_library(0, nullptr); !s.ok()) return s;
    }
    ++g_holders;
    return Status::Ok();
  }
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t))
    return {StatusCode::kInvalidArgument,
            detail::str_cat("unique_id must be ", sizeof(nvshmemx_uniqueid_t), " bytes, got ",
                            unique_id.size())};
  // The user's NVSHMEM_SYMMETRIC_SIZE wins; nvshmem_malloc says later if it is too small.
  if (std::getenv("NVSHMEM_SYMMETRIC_SIZE") == nullptr) {
    const size_t want = heap_bytes + (64u << 20);
    setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(want).c_str(), 1);
  }
  // NVSHMEM binds this PE to the thread's current CUDA context and exits the process when there
  // is none (a rank that has not touched CUDA yet, as under a gloo group): make the current
  // device's primary context current first.
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaFree(nullptr);
  if (err != cudaSuccess)
    return {StatusCode::kInternal,
            detail::str_cat("cannot make CUDA device ", device,
                            " current for NVSHMEM: ", cudaGetErrorString(err))};
  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof id);
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(static_cast<int>(rank), static_cast<int>(world_size), &id,
                                      &attr) != 0)
    return {StatusCode::kInternal, "nvshmemx_set_attr_uniqueid_args failed"};
  if (Status s = init_through_our_device_library(NVSHMEMX_INIT_WITH_UNIQUEID, &attr); !s.ok())
    return s;
  g_started = true;
  *started = true;
  ++g_holders;
  return Status::Ok();
}

void nvshmem_release() {
  if (g_holders > 0) --g_holders;
}

Status SymmetricHeap::open(const std::vector<uint8_t>& unique_id, int64_t world_size, int64_t rank,
                           size_t bytes, const char* for_what, const char* remedy) {
  world_size_ = world_size;
  rank_ = rank;
  if (Status s = nvshmem_acquire(unique_id, world_size, rank, bytes, &started_); !s.ok()) return s;
  joined_ = true;
  base_ = static_cast<uint8_t*>(nvshmem_malloc(bytes));
  if (base_ == nullptr)
    return {StatusCode::kCapacityExceeded,
            detail::str_cat("nvshmem_malloc of ", bytes, " bytes", for_what, " failed: ", remedy)};
  return Status::Ok();
}

Status SymmetricHeap::map_peers(uint8_t** peers, const char* needs, const char* instead) const {
  for (int64_t p = 0; p < world_size_; ++p) {
    peers[p] = static_cast<uint8_t*>(nvshmem_ptr(base_, static_cast<int>(p)));
    if (peers[p] == nullptr)
      return {StatusCode::kUnsupported,
              detail::str_cat(
                  needs, " every rank of the group on this rank's NVLink domain, but rank ", p,
                  " is not reachable through nvshmem_ptr from rank ", rank_, "; ", instead)};
  }
  return Status::Ok();
}

bool SymmetricHeap::all_peers_mapped() const {
  bool all = true;
  for (int pe = 0; pe < static_cast<int>(world_size_); ++pe)
    if (nvshmem_ptr(base_, pe) == nullptr) all = false;
  return all;
}

Status SymmetricHeap::barrier() const {
  UNIEP_CUDA_OK(cudaDeviceSynchronize());
  nvshmem_barrier_all();
  return Status::Ok();
}

void SymmetricHeap::close() {
  if (base_ != nullptr) nvshmem_free(base_);
  base_ = nullptr;
  if (joined_) nvshmem_release();
  joined_ = false;
}

}  // namespace uniep::runtime
