// Which GEMM the CUDA collectives run for their chunks, process-wide (uniep.collectives.set_gemm):
//  - cublas (the default): at::mm on the caller's stream; a GEMM + reduce-scatter folds the
//    partials with a kernel after the GEMM of each own part (the last fold is left after the
//    last GEMM);
//  - cutlass: UniEP's sm90 GEMM (cpp/cuda/gemm) where it takes the operands (bf16 on Hopper,
//    16-byte rows; cuBLAS elsewhere): a GEMM + reduce-scatter folds the peers' partials in the
//    epilogue of its own parts' GEMMs, and the persistent grid leaves `sm_carveout` SMs to the
//    copies, waits and folds queued beside it. Slower than cublas on 7 of the 10 TP=2 shapes
//    (two H200s, 2026-11-23, commit fc5758c), so not the default;
//  - gated: a collective + GEMM runs as one persistent GEMM over all the parts
//    (uniep/cuda/part_gemm.hpp) where the operands fit it (bf16 on Hopper, 16-byte rows, chunks
//    of whole tile clusters; else the cutlass chunk GEMMs): an all-gather + GEMM's tiles wait
//    on the device for their part's arrival, a GEMM + reduce-scatter's parts are pushed as their
//    tiles are stored. The reduce-scatter folds the partials in the reduce order after the GEMM
//    (no epilogue fold), so its bits are the same for every chunking. Its grid leaves
//    `sm_carveout` SMs free.
#pragma once

#include <cstdint>
#include <string>

namespace uniep::torch_glue {

enum class CollGemmBackend { kCublas, kCutlass, kGated };

struct CollGemm {
  CollGemmBackend backend = CollGemmBackend::kCublas;
  int64_t sm_carveout = 0;
};

// Throws kInvalidArgument naming the argument for an unknown backend or a negative carveout.
void set_coll_gemm(const std::string& backend, int64_t sm_carveout);
CollGemm coll_gemm();
const char* coll_gemm_backend_name(CollGemmBackend backend);

}  // namespace uniep::torch_glue
