// A decode loop of one MoE layer from C++ only, as an inference server would run it: the layer
// (uniep::cuda::MoeLayer, include/uniep/cuda/moe_layer.hpp) created once, then steps of 1 to 512
// tokens, each run eagerly and as a CUDA graph replayed on new tokens and routing in the same
// buffers, every output checked against the CPU executor (uniep::cpu_moe_forward) on the same
// bf16 operands; then the same loop on the experts quantized to fp8 (MoeLayerConfig::fp8_experts),
// checked against the CPU executor's fp8 numerics, with w1 as quantized and packed for the first
// GEMM's SwiGLU epilogue (MoeLayerConfig::fp8_w1_packed), whose outputs must be the same bits.
//
// Without a CUDA device the CPU half runs alone: the same steps through the CPU executor, checked
// against a float64 loop (and its fp8 numerics against its bf16 ones). Prints OK and exits 0, or
// names the first mismatch and exits 1.
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
#include <uniep/fp8_weights.hpp>
#include <uniep/status.hpp>

#include "decode_steps.hpp"
#include "example_support.hpp"

namespace {

using decode::cpu_forward;
using decode::device_copy;
using decode::download;
using decode::float64_forward;
using decode::kExperts;
using decode::kFfn;
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

// The decode loop on one layer: every step eager and as a graph replayed on the same and on new
// tokens, each output against the CPU executor run with `tuning` (the layer's numerics).
// Returns each step's eager output.
std::vector<std::vector<uint16_t>> run_layer(
    const uniep::cuda::MoeLayerConfig& config, const decode::StepBuffers& buf, const void* w1,
    const void* w2, const float* w1_scales, const float* w2_scales,
    const std::vector<uint16_t>& host_w1, const std::vector<uint16_t>& host_w2, const char* tuning,
    const char* label, cudaStream_t stream) {
  std::unique_ptr<uniep::cuda::MoeLayer> layer;
  check(uniep::cuda::MoeLayer::create(config, &layer), "MoeLayer::create");
  std::printf("MoeLayer (%s): %zu bytes of device memory for up to %lld tokens\n", label,
              layer->device_bytes(), static_cast<long long>(kMaxTokens));
  std::vector<std::vector<uint16_t>> outputs;
  for (int64_t tokens : kSteps) {
    const uniep::cuda::MoeLayerInputs in = buf.inputs(tokens, w1, w2, w1_scales, w2_scales);
    const size_t n = tokens * kHidden;
    const std::string at = std::string(label) + " at " + std::to_string(tokens) + " tokens";

    // Eager: one forward on the step's tokens.
    const Step a = make_step(tokens, 100 + tokens);
    buf.upload(a, stream);
    check(layer->forward(in, stream), "MoeLayer::forward");
    check(layer->check(stream), "MoeLayer::check (eager)");
    const std::vector<uint16_t> eager = download(buf.out, n, stream);
    outputs.push_back(eager);
    const double err_a = relative_error(eager, widen(cpu_forward(a, host_w1, host_w2, tuning)));

    // The same call captured once, replayed on the same tokens (the same bits) and on new ones.
    cudaGraphExec_t exec = decode::capture_forward(*layer, in, stream);
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    check(layer->check(stream), "MoeLayer::check (replay)");
    expect(download(buf.out, n, stream) == eager,
           "the replay on the same tokens differs from the eager call, " + at);

    const Step b = make_step(tokens, 200 + tokens);
    buf.upload(b, stream);
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");  // warm
    const double us = decode::replay_us(exec, 20, stream);
    check(layer->check(stream), "MoeLayer::check (new tokens)");
    const double err_b = relative_error(download(buf.out, n, stream),
                                        widen(cpu_forward(b, host_w1, host_w2, tuning)));
    std::printf(
        "%s, %3lld tokens: relative error %.3g (eager), %.3g (graph on new tokens) against "
        "the CPU executor; %.1f us a replay\n",
        label, static_cast<long long>(tokens), err_a, err_b, us);
    expect(err_a < 2e-2 && err_b < 2e-2, "the GPU's output against the CPU executor, " + at);
    check_cuda(cudaGraphExecDestroy(exec), "cudaGraphExecDestroy");
  }

  // Bad input is a Status naming the argument, not a launch.
  uniep::cuda::MoeLayerInputs too_many;
  too_many.tokens = kMaxTokens + 1;
  const uniep::Status refused = layer->forward(too_many, stream);
  expect(!refused.ok() && refused.message.find("tokens") != std::string::npos,
         std::string("a step above max_tokens was not refused by name (") + label + ")");
  if (config.fp8_experts) {
    uniep::cuda::MoeLayerInputs no_scales = buf.inputs(1, w1, w2);
    const uniep::Status missing = layer->forward(no_scales, stream);
    expect(!missing.ok() && missing.message.find("w1_scales") != std::string::npos,
           "fp8 experts without their scales were not refused by name");
  }
  return outputs;
}

}  // namespace

int main() {
  std::vector<uint16_t> w1, w2;
  decode::make_weights(&w1, &w2);
  constexpr const char* kFp8 = "dispatch=fp8";

  // A config the fp8 layer cannot take is refused by name at creation, with or without a GPU.
  {
    std::unique_ptr<uniep::cuda::MoeLayer> layer;
    uniep::cuda::MoeLayerConfig across = decode::layer_config(/*fp8=*/true);
    across.world_size = 2;
    uniep::Status s = uniep::cuda::MoeLayer::create(across, {}, &layer);
    expect(!s.ok() && s.message.find("fp8_experts runs at world_size 1") != std::string::npos,
           "fp8 experts across ranks were not refused by name: " + s.message);
    uniep::cuda::MoeLayerConfig stored = decode::layer_config(/*fp8=*/true);
    stored.w1_as_stored = true;
    s = uniep::cuda::MoeLayer::create(stored, &layer);
    expect(!s.ok() && s.message.find("w1_as_stored") != std::string::npos,
           "fp8 experts with w1_as_stored were not refused by name: " + s.message);
    uniep::cuda::MoeLayerConfig packed_bf16 = decode::layer_config();
    packed_bf16.fp8_w1_packed = true;
    s = uniep::cuda::MoeLayer::create(packed_bf16, &layer);
    expect(!s.ok() && s.message.find("fp8_w1_packed") != std::string::npos,
           "fp8_w1_packed without fp8_experts was not refused by name: " + s.message);
  }

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    // The CPU half: the decode steps through the CPU executor, against float64, and its fp8
    // numerics against its bf16 ones (fp8's rounding of the weights, tokens and activation).
    for (int64_t tokens : kSteps) {
      const Step step = make_step(tokens, 100 + tokens);
      const std::vector<uint16_t> bf16 = cpu_forward(step, w1, w2);
      const double err = relative_error(bf16, float64_forward(step, w1, w2));
      const double err8 = relative_error(cpu_forward(step, w1, w2, kFp8), widen(bf16));
      std::printf(
          "CPU executor, %3lld tokens: relative error %.3g against float64; fp8 %.3g against "
          "bf16\n",
          static_cast<long long>(tokens), err, err8);
      expect(err < 2e-2, "CPU executor at " + std::to_string(tokens) + " tokens");
      // e4m3 keeps 3 mantissa bits: 5-10% of the largest output here. A wrong scale or
      // layout is off by the output's own size.
      expect(err8 < 0.2, "CPU executor's fp8 at " + std::to_string(tokens) + " tokens");
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
  const decode::StepBuffers buf = decode::StepBuffers::allocate();

  uint16_t* d_w1 = device_copy(w1, w1.size());
  uint16_t* d_w2 = device_copy(w2, w2.size());
  run_layer(decode::layer_config(), buf, d_w1, d_w2, nullptr, nullptr, w1, w2, "", "bf16", stream);

  // The same experts in fp8, quantized on the host (uniep/fp8_weights.hpp: the CPU executor's
  // rounding, 128 x 128 blocks): w1 [E, H, 2I] -> [E, 2I, H], w2 [E, I, H] -> [E, H, I]. A
  // server would do this once at load, or load weights made by uniep.gemm.
  constexpr int64_t B = uniep::kFp8WeightBlock;
  std::vector<uint8_t> q1(w1.size()), q2(w2.size());
  std::vector<float> s1(kExperts * (kHidden / B) * (2 * kFfn / B));
  std::vector<float> s2(kExperts * (kFfn / B) * (kHidden / B));
  uniep::quantize_expert_weights_fp8(w1.data(), kExperts, kHidden, 2 * kFfn, q1.data(), s1.data());
  uniep::quantize_expert_weights_fp8(w2.data(), kExperts, kFfn, kHidden, q2.data(), s2.data());
  uint8_t* d_q1 = device_copy(q1, q1.size());
  uint8_t* d_q2 = device_copy(q2, q2.size());
  float* d_s1 = device_copy(s1, s1.size());
  float* d_s2 = device_copy(s2, s2.size());
  const std::vector<std::vector<uint16_t>> plain8 = run_layer(
      decode::layer_config(/*fp8=*/true), buf, d_q1, d_q2, d_s1, d_s2, w1, w2, kFp8, "fp8", stream);

  // w1 packed for the SwiGLU epilogue: the same bits at every step.
  std::vector<uint8_t> p1(q1.size());
  std::vector<float> ps1(kExperts * (kHidden / B) * (2 * kFfn / uniep::kGateUpPackRows));
  uniep::pack_gate_up_fp8(q1.data(), s1.data(), kExperts, kFfn, kHidden, p1.data(), ps1.data());
  uint8_t* d_p1 = device_copy(p1, p1.size());
  float* d_ps1 = device_copy(ps1, ps1.size());
  uniep::cuda::MoeLayerConfig packed = decode::layer_config(/*fp8=*/true);
  packed.fp8_w1_packed = true;
  const std::vector<std::vector<uint16_t>> packed8 =
      run_layer(packed, buf, d_p1, d_q2, d_ps1, d_s2, w1, w2, kFp8, "fp8, w1 packed", stream);
  for (size_t i = 0; i < plain8.size(); ++i)
    expect(packed8[i] == plain8[i],
           "fp8 with w1 packed differs from fp8 at " + std::to_string(kSteps[i]) + " tokens");

  buf.free();
  for (void* p : {static_cast<void*>(d_w1), static_cast<void*>(d_w2), static_cast<void*>(d_q1),
                  static_cast<void*>(d_q2), static_cast<void*>(d_s1), static_cast<void*>(d_s2)})
    cudaFree(p);
  cudaFree(d_p1);
  cudaFree(d_ps1);
  cudaStreamDestroy(stream);
  if (failures != 0) {
    std::printf("FAILED (%d mismatches)\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
