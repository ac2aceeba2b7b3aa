// The CPU executor: runs the plan with plain loops. It is the reference every GPU path is
// checked against and what CI runs. Ranks are joined through a Transport (gloo in torch).
#pragma once

#include <cstdint>
#include <vector>

#include "uniep/shape.hpp"
#include "uniep/tuning.hpp"

namespace uniep {

enum class DType { kFloat32, kBFloat16, kFloat64 };
const char* dtype_name(DType dtype);
int64_t dtype_size(DType dtype);

// Collectives the CPU executor needs; every rank calls them in the same order.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t world_size() const = 0;
  // out[r * n + i] = in_of_rank_r[i]
  virtual void all_gather(const int64_t* in, int64_t n, int64_t* out) = 0;
  // send holds W consecutive byte ranges of send_bytes[r]; recv gets recv_bytes[r] from rank r.
  virtual void all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes,
                          uint8_t* recv, const std::vector<int64_t>& recv_bytes) = 0;
};

// World of one rank: no communication.
class LocalTransport final : public Transport {
 public:
  int64_t rank() const override { return 0; }
  int64_t world_size() const override { return 1; }
  void all_gather(const int64_t* in, int64_t n, int64_t* out) override;
  void all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes, uint8_t* recv,
                  const std::vector<int64_t>& recv_bytes) override;
};

// Pointers are host memory, row-major and contiguous, except w1 / w2 when strides are given.
//   x [T, H], topk_idx [T, K] int64, topk_weights [T, K] (float32 or bfloat16, or float64 with
//   float64 x; read and promoted to the accumulation type inside the executor),
//   w1 [E_local, H, 2I] (gate | up), w2 [E_local, I, H], out [T, H].
// Element strides of w1 / w2 (all zero: contiguous). Any strides a framework tensor may have
// (a transposed view, say) are read as they are: the executor widens the weights into its own
// buffer once per call, so a strided view costs no extra copy.
struct WeightStrides {
  int64_t expert = 0, row = 0, col = 0;
  bool contiguous() const { return expert == 0 && row == 0 && col == 0; }
};

struct MoeForwardArgs {
  const void* x = nullptr;
  const int64_t* topk_idx = nullptr;
  const void* topk_weights = nullptr;
  const void* w1 = nullptr;
  const void* w2 = nullptr;
  void* out = nullptr;
  DType dtype = DType::kFloat32;         // of x, w1, w2, out
  DType weight_dtype = DType::kFloat32;  // of topk_weights
  WeightStrides w1_strides, w2_strides;
  MoeShape shape;
  TuningParams tuning;
};

// y[t] = sum_k w[t,k] * W2_e(silu(x W1g_e) * (x W1u_e)), e = topk_idx[t,k], reduced over k in
// ascending order in fp32 (fp64 for float64). GEMM outputs are rounded to dtype as a GPU
// grouped GEMM would round them.
void cpu_moe_forward(const MoeForwardArgs& args, Transport& transport);

// Gradients of cpu_moe_forward. Outputs are written, not accumulated; each has its input's shape
// and dtype, and is contiguous (grad_w1 / grad_w2 too when w1 / w2 are strided).
struct MoeBackwardArgs {
  MoeForwardArgs fwd;  // fwd.out unused
  const void* grad_out = nullptr;
  void* grad_x = nullptr;
  void* grad_topk_weights = nullptr;
  void* grad_w1 = nullptr;
  void* grad_w2 = nullptr;
};
void cpu_moe_backward(const MoeBackwardArgs& args, Transport& transport);

}  // namespace uniep
