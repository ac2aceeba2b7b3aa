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

#include "decode_steps.hpp"
#include "example_support.hpp"

namespace {

using decode::cpu_forward;
using decode::device_copy;
using decode::download;
using decode::float64_forward;
using decode::kHidden;
using decode::kMaxTokens;
using decode::kSteps;
using decode::make_step;
using decode::relative_error;
using decode::Step;
using decode::widen;
using example::check;
using example::check_cuda;

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("MISMATCH: %s\n", what.c_str());
    ++failures;
  }
}

}  // namespace

int main() {
  std::vector<uint16_t> w1, w2;
  decode::make_weights(&w1, &w2);

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
  const uniep::cuda::MoeLayerConfig config = decode::layer_config();
  std::unique_ptr<uniep::cuda::MoeLayer> layer;
  check(uniep::cuda::MoeLayer::create(config, &layer), "MoeLayer::create");
  std::printf("MoeLayer: %zu bytes of device memory for up to %lld tokens\n", layer->device_bytes(),
              static_cast<long long>(kMaxTokens));

  uint16_t* d_w1 = device_copy(w1, w1.size());
  uint16_t* d_w2 = device_copy(w2, w2.size());
  const decode::StepBuffers buf = decode::StepBuffers::allocate();

  for (int64_t tokens : kSteps) {
    const uniep::cuda::MoeLayerInputs in = buf.inputs(tokens, d_w1, d_w2);
    const size_t n = tokens * kHidden;

    // Eager: one forward on the step's tokens.
    const Step a = make_step(tokens, 100 + tokens);
    buf.upload(a, stream);
    check(layer->forward(in, stream), "MoeLayer::forward");
    check(layer->check(stream), "MoeLayer::check (eager)");
    const std::vector<uint16_t> eager = download(buf.out, n, stream);
    const double err_a = relative_error(eager, widen(cpu_forward(a, w1, w2)));

    // The same call captured once, replayed on the same tokens (the same bits) and on new ones.
    cudaGraphExec_t exec = decode::capture_forward(*layer, in, stream);
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(layer->check(stream), "MoeLayer::check (replay)");
    expect(download(buf.out, n, stream) == eager,
           "the replay on the same tokens differs from the eager call at " +
               std::to_string(tokens) + " tokens");

    const Step b = make_step(tokens, 200 + tokens);
    buf.upload(b, stream);
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");  // warm
    const double us = decode::replay_us(exec, 20, stream);
    check(layer->check(stream), "MoeLayer::check (new tokens)");
    const double err_b =
        relative_error(download(buf.out, n, stream), widen(cpu_forward(b, w1, w2)));
    std::printf(
        "%3lld tokens: relative error %.3g (eager), %.3g (graph on new tokens) against "
        "the CPU executor; %.1f us a replay\n",
        static_cast<long long>(tokens), err_a, err_b, us);
    expect(err_a < 2e-2 && err_b < 2e-2,
           "the GPU's output against the CPU executor at " + std::to_string(tokens) + " tokens");
    check_cuda(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  }

  // Bad input is a Status naming the argument, not a launch.
  uniep::cuda::MoeLayerInputs too_many;
  too_many.tokens = kMaxTokens + 1;
  const uniep::Status refused = layer->forward(too_many, stream);
  expect(!refused.ok() && refused.message.find("tokens") != std::string::npos,
         "a step above max_tokens was not refused by name");

  layer.reset();
  buf.free();
  cudaFree(d_w1);
  cudaFree(d_w2);
  cudaStreamDestroy(stream);
  if (failures != 0) {
    std::printf("FAILED (%d mismatches)\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
