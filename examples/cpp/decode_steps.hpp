// What the decode examples share: the layer's shape, the steps' tokens and routing (a
// deterministic generator), the CPU executor and float64 references, and device buffers.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include <uniep/cpu_executor.hpp>
#include <uniep/cuda/moe_layer.hpp>

#include "example_support.hpp"

namespace decode {

using example::check;
using example::check_cuda;
using example::from_bf16;
using example::to_bf16;

// Many small experts, as in decode with Qwen3-like layers; w1 as the model stores it.
constexpr int64_t kHidden = 256, kFfn = 128, kExperts = 64, kTopK = 8, kMaxTokens = 512;
constexpr int64_t kSteps[] = {1, 4, 16, 64, 128, 256, 512};

// A small deterministic generator (the example must not depend on the platform's rand()).
struct Lcg {
  uint64_t state;
  uint32_t next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 33);
  }
  float uniform() { return static_cast<float>(next()) / 2147483648.0f; }  // [0, 1)
};

// The experts' weights: w1 as stored [E, H, 2I] (gate columns, then up) and w2 [E, I, H].
inline void make_weights(std::vector<uint16_t>* w1, std::vector<uint16_t>* w2) {
  Lcg rng{7};
  w1->resize(kExperts * kHidden * 2 * kFfn);
  w2->resize(kExperts * kFfn * kHidden);
  for (auto& v : *w1) v = to_bf16((2.0f * rng.uniform() - 1.0f) / 16.0f);
  for (auto& v : *w2) v = to_bf16((2.0f * rng.uniform() - 1.0f) / 11.0f);
}

struct Step {
  int64_t tokens = 0;
  std::vector<uint16_t> x;          // [T, H] bf16
  std::vector<int64_t> topk_idx;    // [T, K], distinct experts per token, some -1
  std::vector<float> topk_weights;  // [T, K]
};

inline Step make_step(int64_t tokens, uint64_t seed) {
  Lcg rng{seed};
  Step s;
  s.tokens = tokens;
  s.x.resize(tokens * kHidden);
  for (auto& v : s.x) v = to_bf16(2.0f * rng.uniform() - 1.0f);
  s.topk_idx.resize(tokens * kTopK);
  s.topk_weights.resize(tokens * kTopK);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < kTopK; ++k) {
      int64_t e;
      bool taken;
      do {  // distinct experts per token, as a top-k gate picks them
        e = rng.next() % kExperts;
        taken = false;
        for (int64_t j = 0; j < k; ++j) taken = taken || s.topk_idx[t * kTopK + j] == e;
      } while (taken);
      s.topk_idx[t * kTopK + k] = rng.uniform() < 0.05f ? -1 : e;  // a dropped choice now and then
      s.topk_weights[t * kTopK + k] = rng.uniform();
    }
  }
  return s;
}

// The CPU executor on the step's bf16 operands: out [T, H] bf16 as uint16. `tuning`
// "dispatch=fp8": the fp8 layer's numerics (the weights rounded in 128 x 128 blocks, the tokens
// and the activation in 1 x 128 blocks).
inline std::vector<uint16_t> cpu_forward(const Step& s, const std::vector<uint16_t>& w1,
                                         const std::vector<uint16_t>& w2, const char* tuning = "") {
  std::vector<uint16_t> out(s.tokens * kHidden);
  uniep::MoeForwardArgs args;
  args.x = s.x.data();
  args.topk_idx = s.topk_idx.data();
  args.topk_weights = s.topk_weights.data();
  args.w1 = w1.data();
  args.w2 = w2.data();
  args.out = out.data();
  args.dtype = uniep::DType::kBFloat16;
  args.weight_dtype = uniep::DType::kFloat32;
  args.shape.tokens = s.tokens;
  args.shape.hidden = kHidden;
  args.shape.ffn_hidden = kFfn;
  args.shape.num_experts = kExperts;
  args.shape.top_k = kTopK;
  args.tuning = uniep::TuningParams::parse(tuning);
  uniep::LocalTransport transport;
  uniep::cpu_moe_forward(args, transport);
  return out;
}

// The largest |a - b| over the largest |b|.
inline double relative_error(const std::vector<uint16_t>& a, const std::vector<double>& b) {
  double err = 0.0, scale = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    err = std::fmax(err, std::fabs(double(from_bf16(a[i])) - b[i]));
    scale = std::fmax(scale, std::fabs(b[i]));
  }
  return err / scale;
}

inline std::vector<double> widen(const std::vector<uint16_t>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_bf16(v[i]);
  return out;
}

// y[t] = sum_k w[t,k] * (silu(x W1g) * (x W1u)) W2, in float64 with the activation rounded to
// bf16 as the executors round it.
inline std::vector<double> float64_forward(const Step& s, const std::vector<uint16_t>& w1,
                                           const std::vector<uint16_t>& w2) {
  const int64_t H = kHidden, I = kFfn;
  std::vector<double> y(s.tokens * H, 0.0), h(I);
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t k = 0; k < kTopK; ++k) {
      const int64_t e = s.topk_idx[t * kTopK + k];
      if (e < 0) continue;
      for (int64_t j = 0; j < I; ++j) {
        double gate = 0.0, up = 0.0;
        for (int64_t n = 0; n < H; ++n) {
          const double xv = from_bf16(s.x[t * H + n]);
          gate += xv * from_bf16(w1[(e * H + n) * 2 * I + j]);
          up += xv * from_bf16(w1[(e * H + n) * 2 * I + I + j]);
        }
        h[j] = from_bf16(to_bf16(static_cast<float>(gate / (1.0 + std::exp(-gate)) * up)));
      }
      for (int64_t n = 0; n < H; ++n) {
        double acc = 0.0;
        for (int64_t j = 0; j < I; ++j) acc += h[j] * from_bf16(w2[(e * I + j) * H + n]);
        y[t * H + n] += double(s.topk_weights[t * kTopK + k]) * acc;
      }
    }
  }
  return y;
}

template <typename T>
T* device_copy(const std::vector<T>& host, size_t capacity) {
  T* ptr = nullptr;
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr), capacity * sizeof(T)), "cudaMalloc");
  check_cuda(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
             "upload");
  return ptr;
}

template <typename T>
void upload(T* dst, const std::vector<T>& src, cudaStream_t stream) {
  check_cuda(
      cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
      "upload");
}

// A step's tokens and routing into the layer's input buffers, where a captured graph reads them.
inline void upload_step(const Step& step, uint16_t* x, int64_t* topk_idx, float* topk_weights,
                        cudaStream_t stream) {
  upload(x, step.x, stream);
  upload(topk_idx, step.topk_idx, stream);
  upload(topk_weights, step.topk_weights, stream);
}

inline std::vector<uint16_t> download(const uint16_t* src, size_t n, cudaStream_t stream) {
  std::vector<uint16_t> out(n);
  check_cuda(cudaMemcpyAsync(out.data(), src, n * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream),
             "download");
  check_cuda(cudaStreamSynchronize(stream), "download");
  return out;
}

// The layer of the decode examples at world 1: w1 as the model stores it, or (fp8) fp8 experts.
inline uniep::cuda::MoeLayerConfig layer_config(bool fp8 = false) {
  uniep::cuda::MoeLayerConfig config;
  config.max_tokens = kMaxTokens;
  config.hidden = kHidden;
  config.ffn = kFfn;
  config.num_experts = kExperts;
  config.top_k = kTopK;
  config.w1_as_stored = !fp8;
  config.fp8_experts = fp8;
  return config;
}

// A step's device buffers, sized for the largest step, as a server keeps them.
struct StepBuffers {
  uint16_t* x = nullptr;          // [max_tokens, H]
  int64_t* topk_idx = nullptr;    // [max_tokens, K]
  float* topk_weights = nullptr;  // [max_tokens, K]
  uint16_t* out = nullptr;        // [max_tokens, H]

  static StepBuffers allocate() {
    StepBuffers b;
    b.x = device_copy(std::vector<uint16_t>{}, kMaxTokens * kHidden);
    b.topk_idx = device_copy(std::vector<int64_t>{}, kMaxTokens * kTopK);
    b.topk_weights = device_copy(std::vector<float>{}, kMaxTokens * kTopK);
    b.out = device_copy(std::vector<uint16_t>{}, kMaxTokens * kHidden);
    return b;
  }
  // The layer's inputs for a step of `tokens` on these buffers and the given experts.
  uniep::cuda::MoeLayerInputs inputs(int64_t tokens, const void* w1, const void* w2,
                                     const float* w1_scales = nullptr,
                                     const float* w2_scales = nullptr) const {
    uniep::cuda::MoeLayerInputs in;
    in.w1_scales = w1_scales;
    in.w2_scales = w2_scales;
    in.x = x;
    in.tokens = tokens;
    in.topk_idx = topk_idx;
    in.topk_weights = topk_weights;
    in.w1 = w1;
    in.w2 = w2;
    in.out = out;
    return in;
  }
  // A step's tokens and routing into the buffers, where a captured graph reads them.
  void upload(const Step& step, cudaStream_t stream) const {
    upload_step(step, x, topk_idx, topk_weights, stream);
  }
  void free() const {
    for (void* p : {static_cast<void*>(x), static_cast<void*>(topk_idx),
                    static_cast<void*>(topk_weights), static_cast<void*>(out)})
      cudaFree(p);
  }
};

// One forward captured in a CUDA graph on `stream`, instantiated.
inline cudaGraphExec_t capture_forward(uniep::cuda::MoeLayer& layer,
                                       const uniep::cuda::MoeLayerInputs& in, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  check(layer.forward(in, stream), "MoeLayer::forward (captured)");
  check_cuda(cudaStreamEndCapture(stream, &graph), "capture");
  check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  check_cuda(cudaGraphDestroy(graph), "cudaGraphDestroy");
  return exec;
}

// The mean time of `replays` launches of `exec` on `stream`, in microseconds (CUDA events).
inline double replay_us(cudaGraphExec_t exec, int replays, cudaStream_t stream) {
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
  check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < replays; ++i) check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
  check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
  check_cuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0.0f;
  check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 1e3 * ms / replays;
}

}  // namespace decode
