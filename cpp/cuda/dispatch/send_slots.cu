// Send slots: the receive slot of each (token, destination) pair. Slots on a destination are
// ordered by (source rank, source token), so ours start at send_base[d] (the exclusive prefix
// over lower source ranks) and follow our token order: an exclusive scan of token_in_rank.
#include <cub/block/block_scan.cuh>

#include "cuda/ep_kernels.hpp"

namespace uniep::cuda {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads)
    send_slots_kernel(const bool* token_in_rank, int64_t tokens, int64_t world_size,
                      const int64_t* send_base, const int32_t* round_ok, int64_t* send_slot) {
  if (*round_ok == 0) return;  // no plan: send_base is not this round's
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int64_t dst = blockIdx.x;
  int64_t running = send_base[dst];
  for (int64_t t0 = 0; t0 < tokens; t0 += kThreads) {
    const int64_t t = t0 + threadIdx.x;
    const int64_t flag = (t < tokens && token_in_rank[t * world_size + dst]) ? 1 : 0;
    int64_t prefix, total;
    Scan(temp).ExclusiveSum(flag, prefix, total);
    if (t < tokens) send_slot[t * world_size + dst] = flag ? running + prefix : -1;
    running += total;
    __syncthreads();  // temp is reused by the next chunk
  }
}

}  // namespace

void launch_send_slots(const bool* token_in_rank, int64_t tokens, const EpDims& d,
                       const int64_t* send_base, const int32_t* round_ok, int64_t* send_slot,
                       cudaStream_t stream) {
  if (tokens == 0) return;
  send_slots_kernel<<<static_cast<unsigned>(d.world_size), kThreads, 0, stream>>>(
      token_in_rank, tokens, d.world_size, send_base, round_ok, send_slot);
}

}  // namespace uniep::cuda
