// The compiled configurations of the grouped GEMM, as the dispatcher (sm90_grouped_gemm.cu) sees
// them: a description and two entry points each, with no CUTLASS type in sight. Each is defined
// in its own sm90_grouped_<name>.cu from grouped_run.cuh.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/grouped/grouped_workspace.hpp"
#include "uniep/cuda/grouped_gemm.hpp"

namespace uniep::cuda::grouped {

struct GroupedEntry {
  GroupedGemmConfig config;
  // CUTLASS's own workspace (per-SM TMA descriptors) for E groups on sm_count SMs.
  size_t (*gemm_workspace_bytes)(int64_t num_experts, int sm_count);
  // Run the grouped kernel over the problems the problem kernel wrote into `ws`: D = x w
  // (ld_out unused), or the SwiGLU activation of the gate/up-interleaved product, ld_out
  // elements between rows of out.
  Status (*run)(const Workspace& ws, int64_t num_experts, int64_t ld_out, int device, int sm_count,
                cudaStream_t stream);
  Status (*run_swiglu)(const Workspace& ws, int64_t num_experts, int64_t ld_out, int device,
                       int sm_count, cudaStream_t stream);  // null but for the forward kind
  // run_swiglu's SwiGLU with w1 as stored (PlainGateUpMainloop): n / 2 must be a multiple of
  // tile_n / 2. Null but for the forward kind.
  Status (*run_swiglu_plain)(const Workspace& ws, int64_t num_experts, int64_t ld_out, int device,
                             int sm_count, cudaStream_t stream, const PlainW1& plain);
  // run's product stored in fp32, the accumulator as is (the problem kernel wrote fp32 row
  // pointers). Null but for the forward kind.
  Status (*run_f32)(const Workspace& ws, int64_t num_experts, int64_t ld_out, int device,
                    int sm_count, cudaStream_t stream);
};

const GroupedEntry& entry_coop_128x256x64();
const GroupedEntry& entry_coop_128x128x64();
const GroupedEntry& entry_coop_256x128x64();
const GroupedEntry& entry_pingpong_64x128x128();
const GroupedEntry& entry_pingpong_64x256x64();
const GroupedEntry& entry_pingpong_64x256x64_c1();  // the same tile in clusters of one
// The backward's products (GroupedGemmKind kDgrad, kWgrad), chosen by shape only.
const GroupedEntry& entry_dgrad_coop_128x256x64();
const GroupedEntry& entry_dgrad_pingpong_64x256x64();
const GroupedEntry& entry_dgrad_pingpong_64x256x64_c1();
const GroupedEntry& entry_wgrad_coop_128x256x64();
const GroupedEntry& entry_wgrad_coop_128x128x64();
const GroupedEntry& entry_wgrad_pingpong_64x256x64();

}  // namespace uniep::cuda::grouped
