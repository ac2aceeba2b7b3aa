// Launcher of the grouped-GEMM row-list kernels (expert_rows.cu). Host-only types, so that the
// torch glue (plain C++) can call it: DeviceError is only declared here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace uniep::cuda {

struct DeviceError;

// The grouped-GEMM row lists of the received slots (expert_rows.cu): rows of local expert e are
// [expert_offsets[e], expert_offsets[e + 1]), the slots that chose e in (slot, k) order; the
// same lists as the CPU planner's uniep::plan_experts.
struct ExpertRowsArgs {
  const int64_t* token;  // slot s's source token at token[s * token_stride]
  const int64_t* ids;    // its top_k global expert ids at ids[s * ids_stride + k]
  int64_t token_stride, ids_stride;
  int64_t slots;
  const int64_t* recv_offsets;    // [world_size + 1]: first slot of each source rank
  const int64_t* expert_offsets;  // [experts_per_rank + 1]: first row of each local expert
  int64_t world_size, first_expert, experts_per_rank, top_k;
  int64_t max_tokens;  // row_target = source * max_tokens * top_k + token * top_k + k
  int64_t* unit_rows;  // scratch of expert_rows_scratch_bytes(slots, experts_per_rank)
  int64_t* row_slot;
  int64_t* row_target;
  DeviceError* err;  // kExpertRows when an expert's rows differ from its offsets; may be null
};
size_t expert_rows_scratch_bytes(int64_t slots, int64_t experts_per_rank);
// Most local experts the kernels take (a unit's per-expert cursors live in shared memory).
int64_t expert_rows_max_experts();
// Three kernels on `stream`, no sync; nothing for zero slots.
void launch_expert_rows(const ExpertRowsArgs& a, cudaStream_t stream);
// The same in two steps, for a caller that derives expert_offsets itself (torch's expert_rows):
// after the count, unit_rows is [experts_per_rank][units] of rows per (expert, 32-slot unit),
// whose row sums are the rows per expert; the place step reads expert_offsets.
void launch_expert_rows_count(const ExpertRowsArgs& a, cudaStream_t stream);
void launch_expert_rows_place(const ExpertRowsArgs& a, cudaStream_t stream);

// Each GEMM row's routing weight: out[r] = slot_weights[row_slot[r] * top_k + k], k the choice
// row_target[r] names (row_target % top_k, ExpertRowsArgs). One launch where torch took four
// ops (and their host time) on the backward's path; nothing for zero rows.
void launch_row_weights(const float* slot_weights, const int64_t* row_slot,
                        const int64_t* row_target, int64_t rows, int64_t top_k, float* out,
                        cudaStream_t stream);

}  // namespace uniep::cuda
