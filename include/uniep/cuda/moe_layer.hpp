// The MoE layer's forward as one call, for inference servers written in C++: routing in, output
// out, on the caller's stream, with the device memory sized once at creation; at world 1 or with
// expert parallelism across the ranks of one NVLink domain.
//
//   out[t] = sum_k topk_weights[t, k] * expert_(topk_idx[t, k])(x[t]),
//   expert_e(v) = (silu(v w1_gate[e]) * (v w1_up[e])) w2[e]
//
// World 1 (every expert on this GPU): one forward is the plan of the routing
// (plan_local_rows_async, uniep/cuda/send_rows.hpp) and the MegaKernel (moe_fused_forward_bf16,
// uniep/cuda/fused_moe.hpp): three launches and a memset. With fp8 experts (fp8_experts, world
// 1): the plan, each token quantized once into its GEMM rows (quantize_fp8_rows), the two fp8
// grouped GEMMs around swiglu_fp8, or with fp8_w1_packed the first with SwiGLU in its epilogue
// and quantize_fp8 after it (uniep/cuda/grouped_gemm.hpp), and the combine of the rows
// (combine_rows_bf16): the launches of uniep.moe.fp8_local, so the bits of
// moe_forward_prepared on fp8 experts with dispatch=fp8 at world 1. Across ranks (world_size > 1,
// rank r holding experts [r E / W, (r + 1) E / W)): the fused runtime of uniep/cuda/fused_ep.hpp,
// whose count exchange, plan and persistent kernel run on the device; every rank makes the same
// calls in the same order. Either way no allocation and no host sync, so a decode step can be
// captured in a CUDA graph once per batch size and replayed with new tokens and routing in the
// same buffers. The bits are those of torch.ops.uniep.moe_forward (and of
// uniep.moe.megakernel.launch.moe_forward_local) on the same operands, whatever the tile or the
// world size.
//
// Errors found on the device (an expert id >= num_experts, a wait that timed out) are recorded,
// not raised, by forward: check() reads them, waiting for the stream. A server checks after a
// step it can afford to wait for, or at a cadence of its choosing.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "uniep/status.hpp"

namespace uniep::cuda {

struct MoeLayerConfig {
  int64_t max_tokens = 0;   // the most tokens one forward takes (its buffers are sized for them)
  int64_t hidden = 0;       // H, a multiple of 64
  int64_t ffn = 0;          // I, each expert's FFN size, a multiple of 64
  int64_t num_experts = 0;  // global: a multiple of world_size, this rank holding E / W of them
  int64_t top_k = 0;        // in [1, 32]
  // Expert parallelism: the ranks of one NVLink domain, each with its own MoeLayer made by
  // create(config, unique_id, ...) with the same config but its rank.
  int64_t world_size = 1;
  int64_t rank = 0;
  // w1 as the model stores it, [E][H][2I] with the gate columns [0, I) then the up columns,
  // read without a packed copy (I a multiple of 128, or of 64 with tile_n 128); otherwise in
  // uniep.gemm.pack_gate_up's layout (gate and up interleaved in blocks of 8 columns).
  bool w1_as_stored = false;
  // The kernel's tile rows, 64 or 128, fixed at creation (the plan counts tiles of this height);
  // 0: 64 where max_tokens x top_k rows average at most grouped_gemm_pingpong_rows(device) an
  // expert, else 128 (uniep.moe.megakernel.launch.fused_tile_m's choice).
  int tile_m = 0;
  // The tile columns (FusedMoeLaunch::tile_n): 0 for the launch's choice per call, 256, or 128
  // with 64-row tiles.
  int tile_n = 0;
  // Prepared fp8 experts (world 1 only; hidden and ffn multiples of 128): w1 [E][2 ffn][hidden]
  // and w2 [E][hidden][ffn] e4m3 (OCP "fn"), each the transpose of the bf16 weight (w1's rows
  // the gate columns, then the up columns, as stored), with one fp32 scale per 128 x 128 block,
  // MoeLayerInputs::w1_scales [E][hidden / 128][2 ffn / 128] and w2_scales
  // [E][ffn / 128][hidden / 128] (w[e][k, n] ~ q[e][n, k] x scales[e][k / 128][n / 128]): the
  // format of uniep.gemm.quantize_expert_weights (uniep.moe.prepared's "fp8" experts with w1
  // packed: fp8_w1_packed; a checkpoint's own fp8 blocks may need their scales transposed).
  // The tokens are quantized in
  // 1 x 128 blocks and the activation the same way before the second GEMM. tile_m, tile_n and
  // w1_as_stored are the MegaKernel's and stay unset: the fp8 GEMMs pick their tile by the rows
  // per expert (grouped_gemm_fp8_select).
  bool fp8_experts = false;
  // fp8_experts with w1's rows and w1_scales packed for the first GEMM's SwiGLU epilogue
  // (uniep.gemm.pack_gate_up_fp8, uniep.moe.prepared's "fp8" experts): packed row
  // c + 64 g + 128 j is the row g ffn + 64 j + c above (c < 64, g 0 gate / 1 up, j < ffn / 64),
  // w1_scales [E][hidden / 128][2 ffn / 64] holding each 64-row group's 128 x 128 block scale.
  // The same bits; the [rows, 2 ffn] product never reaches memory, one pass over [rows, ffn]
  // quantizes the activation.
  bool fp8_w1_packed = false;
  int device = -1;         // -1: the current device at creation
  double timeout_s = 100;  // bound of every wait inside a forward; 0: none (tests only)
};

struct MoeLayerInputs {
  const void* x = nullptr;              // [tokens][hidden] bf16
  int64_t tokens = 0;                   // in [0, max_tokens]
  const int64_t* topk_idx = nullptr;    // [tokens][top_k] global expert ids, -1: unused
  const float* topk_weights = nullptr;  // [tokens][top_k]
  const void* w1 = nullptr;  // [E / W][hidden][2 ffn] bf16, this rank's (see w1_as_stored)
  const void* w2 = nullptr;  // [E / W][ffn][hidden] bf16
  // fp8_experts: w1 and w2 in e4m3 with their block scales (MoeLayerConfig::fp8_experts).
  const float* w1_scales = nullptr;
  const float* w2_scales = nullptr;
  void* out = nullptr;  // [tokens][hidden] bf16
};

class MoeLayer {
 public:
  // Checks the config and allocates the layer's device memory on config.device (one
  // cudaMalloc): errors name the argument. Needs a compute capability 9.0 GPU.
  static Status create(const MoeLayerConfig& config, std::unique_ptr<MoeLayer>* layer);
  // The same across ranks (world_size > 1), collective: every rank calls it with rank 0's unique
  // id (uniep::ep::make_unique_id on rank 0, its bytes broadcast by the server's own transport).
  // The NVSHMEM symmetric heap must hold symmetric_heap_bytes(config) (NVSHMEM_SYMMETRIC_SIZE,
  // set before the process's first UniEP runtime starts NVSHMEM).
  static Status create(const MoeLayerConfig& config, const std::vector<uint8_t>& unique_id,
                       std::unique_ptr<MoeLayer>* layer);
  // Symmetric heap bytes a layer across ranks allocates (0 at world 1).
  static size_t symmetric_heap_bytes(const MoeLayerConfig& config);
  // Across ranks freeing the layer frees symmetric memory: collective, every rank frees its own.
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // Enqueues one forward on `stream` (on config.device). The layer's buffers are the call's
  // until the stream has run it: forwards on one layer must be ordered on one stream (or by
  // events). Device pointers, 16-byte aligned; tokens = 0 writes nothing.
  Status forward(const MoeLayerInputs& in, cudaStream_t stream);

  // Waits for `stream`, then returns the first error the last forward recorded on the device:
  // an expert id outside [-1, num_experts) (naming the entry), or a wait that timed out (naming
  // the tile). OK when none.
  Status check(cudaStream_t stream);

  const MoeLayerConfig& config() const;
  // The device memory the layer holds outside the symmetric heap.
  size_t device_bytes() const;

 private:
  struct State;
  explicit MoeLayer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace uniep::cuda
