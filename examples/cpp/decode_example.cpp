// A decode loop of one MoE layer from C++ only, as an inference server would run it: the layer
// (uniep::cuda::MoeLayer, include/uniep/cuda/moe_layer.hpp) created once, then steps of 1 to 512
// tokens, each run eagerly and as a CUDA graph replayed on new tokens and routing in the same
// buffers, every output checked against the CPU executor (uniep::cpu_moe_forward) on the same
// bf16 operands.
//
// Without a CUDA device the CPU half runs alone: the same steps through the CPU executor, checked
// against a float64 loop. Prints OK and exits 0, or names the first mismatch and exits 1.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <uniep/cpu_executor.hpp>
#include <uniep/cuda/moe_layer.hpp>
#include <uniep/status.hpp>

#include "example_support.hpp"

namespace {

using example::check;
using example::check_cuda;
using example::from_bf16;
using example::to_bf16;

// Many small experts, as in decode with Qwen3-like layers; w1 as the model stores it.
constexpr int64_t kHidden = 256, kFfn = 128, kExperts = 64, kTopK = 8, kMaxTokens = 512;
constexpr int64_t kSteps[] = {1, 4, 16, 64, 128, 256, 512};

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("MISMATCH: %s\n", what.c_str());
    ++failures;
  }
}

// A small deterministic generator (the example must not depend on the platform's rand()).
struct Lcg {
  uint64_t state;
  uint32_t next() {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 33);
  }
  float uniform() { return static_cast<float>(next()) / 2147483648.0f; }  // [0, 1)
};

struct Step {
  int64_t tokens = 0;
  std::vector<uint16_t> x;          // [T, H] bf16
  std::vector<int64_t> topk_idx;    // [T, K], distinct experts per token, some -1
  std::vector<float> topk_weights;  // [T, K]
};

Step make_step(int64_t tokens, uint64_t seed) {
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

// The CPU executor on the step's bf16 operands: out [T, H] bf16 as uint16.
std::vector<uint16_t> cpu_forward(const Step& s, const std::vector<uint16_t>& w1,
                                  const std::vector<uint16_t>& w2) {
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
  uniep::LocalTransport transport;
  uniep::cpu_moe_forward(args, transport);
  return out;
}

// The largest |a - b| over the largest |b|.
double relative_error(const std::vector<uint16_t>& a, const std::vector<double>& b) {
  double err = 0.0, scale = 1e-30;
  for (size_t i = 0; i < b.size(); ++i) {
    err = std::fmax(err, std::fabs(double(from_bf16(a[i])) - b[i]));
    scale = std::fmax(scale, std::fabs(b[i]));
  }
  return err / scale;
}

std::vector<double> widen(const std::vector<uint16_t>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = from_bf16(v[i]);
  return out;
}

// y[t] = sum_k w[t,k] * (silu(x W1g) * (x W1u)) W2, in float64 with the activation rounded to
// bf16 as the executors round it.
std::vector<double> float64_forward(const Step& s, const std::vector<uint16_t>& w1,
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
void upload_step(const Step& step, uint16_t* x, int64_t* topk_idx, float* topk_weights,
                 cudaStream_t stream) {
  upload(x, step.x, stream);
  upload(topk_idx, step.topk_idx, stream);
  upload(topk_weights, step.topk_weights, stream);
}

std::vector<uint16_t> download(const uint16_t* src, size_t n, cudaStream_t stream) {
  std::vector<uint16_t> out(n);
  check_cuda(cudaMemcpyAsync(out.data(), src, n * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream),
             "download");
  check_cuda(cudaStreamSynchronize(stream), "download");
  return out;
}

}  // namespace

int main() {
  // The experts' weights, w1 as stored [E, H, 2I] (gate columns, then up) and w2 [E, I, H].
  Lcg rng{7};
  std::vector<uint16_t> w1(kExperts * kHidden * 2 * kFfn), w2(kExperts * kFfn * kHidden);
  for (auto& v : w1) v = to_bf16((2.0f * rng.uniform() - 1.0f) / 16.0f);
  for (auto& v : w2) v = to_bf16((2.0f * rng.uniform() - 1.0f) / 11.0f);

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    // The CPU half: the decode steps through the CPU executor, against float64.
    for (int64_t tokens : kSteps) {
      const Step step = make_step(tokens, 100 + tokens);
      const double err = relative_error(cpu_forward(step, w1, w2), float64_forward(step, w1, w2));
      std::printf("CPU executor, %3lld tokens: relative error %.3g against float64\n",
                  static_cast<long long>(tokens), err);
      expect(err < 2e-2, "CPU executor at " + std::to_string(tokens) + " tokens");
    }
    std::printf("no CUDA device: the GPU decode loop is skipped\n");
    if (failures != 0) {
      std::printf("FAILED (%d mismatches)\n", failures);
      return 1;
    }
    std::printf("OK\n");
    return 0;
  }

  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  uniep::cuda::MoeLayerConfig config;
  config.max_tokens = kMaxTokens;
  config.hidden = kHidden;
  config.ffn = kFfn;
  config.num_experts = kExperts;
  config.top_k = kTopK;
  config.w1_as_stored = true;
  std::unique_ptr<uniep::cuda::MoeLayer> layer;
  check(uniep::cuda::MoeLayer::create(config, &layer), "MoeLayer::create");
  std::printf("MoeLayer: %zu bytes of device memory for up to %lld tokens\n", layer->device_bytes(),
              static_cast<long long>(kMaxTokens));

  // The step's buffers, sized for the largest step, as a server keeps them.
  uint16_t* d_w1 = device_copy(w1, w1.size());
  uint16_t* d_w2 = device_copy(w2, w2.size());
  uint16_t* d_x = device_copy(std::vector<uint16_t>{}, kMaxTokens * kHidden);
  int64_t* d_idx = device_copy(std::vector<int64_t>{}, kMaxTokens * kTopK);
  float* d_weights = device_copy(std::vector<float>{}, kMaxTokens * kTopK);
  uint16_t* d_out = device_copy(std::vector<uint16_t>{}, kMaxTokens * kHidden);
  cudaEvent_t start, stop;
  check_cuda(cudaEventCreate(&start), "cudaEventCreate");
  check_cuda(cudaEventCreate(&stop), "cudaEventCreate");

  for (int64_t tokens : kSteps) {
    uniep::cuda::MoeLayerInputs in;
    in.x = d_x;
    in.tokens = tokens;
    in.topk_idx = d_idx;
    in.topk_weights = d_weights;
    in.w1 = d_w1;
    in.w2 = d_w2;
    in.out = d_out;
    const size_t n = tokens * kHidden;

    // Eager: one forward on the step's tokens.
    const Step a = make_step(tokens, 100 + tokens);
    upload_step(a, d_x, d_idx, d_weights, stream);
    check(layer->forward(in, stream), "MoeLayer::forward");
    check(layer->check(stream), "MoeLayer::check (eager)");
    const std::vector<uint16_t> eager = download(d_out, n, stream);
    const double err_a = relative_error(eager, widen(cpu_forward(a, w1, w2)));

    // The same call captured once, replayed on the same tokens (the same bits) and on new ones.
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
    check(layer->forward(in, stream), "MoeLayer::forward (captured)");
    check_cuda(cudaStreamEndCapture(stream, &graph), "capture");
    check_cuda(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(layer->check(stream), "MoeLayer::check (replay)");
    expect(download(d_out, n, stream) == eager,
           "the replay on the same tokens differs from the eager call at " +
               std::to_string(tokens) + " tokens");

    const Step b = make_step(tokens, 200 + tokens);
    upload_step(b, d_x, d_idx, d_weights, stream);
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");  // warm
    check_cuda(cudaEventRecord(start, stream), "cudaEventRecord");
    constexpr int kReplays = 20;
    for (int i = 0; i < kReplays; ++i) check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check_cuda(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(layer->check(stream), "MoeLayer::check (new tokens)");
    float ms = 0.0f;
    check_cuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    const double err_b = relative_error(download(d_out, n, stream), widen(cpu_forward(b, w1, w2)));
    std::printf(
        "%3lld tokens: relative error %.3g (eager), %.3g (graph on new tokens) against "
        "the CPU executor; %.1f us a replay\n",
        static_cast<long long>(tokens), err_a, err_b, 1e3 * ms / kReplays);
    expect(err_a < 2e-2 && err_b < 2e-2,
           "the GPU's output against the CPU executor at " + std::to_string(tokens) + " tokens");
    check_cuda(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
    check_cuda(cudaGraphDestroy(graph), "cudaGraphDestroy");
  }

  // Bad input is a Status naming the argument, not a launch.
  uniep::cuda::MoeLayerInputs too_many;
  too_many.tokens = kMaxTokens + 1;
  const uniep::Status refused = layer->forward(too_many, stream);
  expect(!refused.ok() && refused.message.find("tokens") != std::string::npos,
         "a step above max_tokens was not refused by name");

  layer.reset();
  for (void* p :
       {static_cast<void*>(d_w1), static_cast<void*>(d_w2), static_cast<void*>(d_x),
        static_cast<void*>(d_idx), static_cast<void*>(d_weights), static_cast<void*>(d_out)})
    cudaFree(p);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  if (failures != 0) {
    std::printf("FAILED (%d mismatches)\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
