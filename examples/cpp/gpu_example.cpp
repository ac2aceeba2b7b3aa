// UniEP's GPU runtime from C++ (uniep::cuda): one process, one GPU, a world of one rank.
//
// 1. The routing layout computed on the device equals the CPU planner's.
// 2. One dispatch and one combine of the slot-indexed plan, with identity "experts" (each expert
//    returns the rows it received), so out[t] = sum_k w[t,k] * x[t], summed in fp32 and stored as
//    bf16; the dispatch's row lists equal the planner's.
//
// Prints OK and exits 0; on a machine without a CUDA device it says so and exits 0 too, so that
// it can run in CI. A real server creates one Runtime per rank, with the unique id of rank 0
// broadcast over its own transport (see uniep/cuda/ep.hpp).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <uniep/cuda/ep.hpp>
#include <uniep/cuda/layout.hpp>
#include <uniep/plan.hpp>
#include <uniep/status.hpp>

#include "example_support.hpp"

namespace {

using example::check;
using example::check_cuda;
using example::from_bf16;
using example::to_bf16;

// A device array that frees itself.
template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  explicit DeviceArray(size_t n) {
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr), (n > 0 ? n : 1) * sizeof(T)),
               "cudaMalloc");
  }
  ~DeviceArray() { cudaFree(ptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
};

template <typename T>
void upload(DeviceArray<T>& dst, const std::vector<T>& src) {
  check_cuda(cudaMemcpy(dst.ptr, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice),
             "upload");
}

template <typename T>
std::vector<T> download(const T* src, size_t n) {
  std::vector<T> out(n);
  check_cuda(cudaMemcpy(out.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return out;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: the GPU example is skipped\n");
    return 0;
  }
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");

  const int64_t T = 64, H = 256, K = 2, E = 8, W = 1;
  std::vector<int64_t> topk_idx(T * K);
  std::vector<float> topk_weights(T * K);
  std::vector<uint16_t> x(T * H);
  for (int64_t t = 0; t < T; ++t) {
    topk_idx[t * K] = t % E;
    topk_idx[t * K + 1] = t % 5 == 0 ? -1 : (t * 3 + 1) % E;  // some tokens use one expert
    if (topk_idx[t * K + 1] == topk_idx[t * K]) topk_idx[t * K + 1] = -1;
    topk_weights[t * K] = 0.75f;
    topk_weights[t * K + 1] = 0.25f;
  }
  for (size_t i = 0; i < x.size(); ++i) x[i] = to_bf16(std::sin(0.01f * float(i)));

  DeviceArray<int64_t> d_topk(T * K);
  DeviceArray<float> d_weights(T * K);
  DeviceArray<uint16_t> d_x(T * H);
  upload(d_topk, topk_idx);
  upload(d_weights, topk_weights);
  upload(d_x, x);

  // ---- 1. the routing layout, on the device and on the host ----
  uniep::MoeShape shape;
  shape.tokens = T;
  shape.hidden = H;
  shape.ffn_hidden = H;
  shape.num_experts = E;
  shape.top_k = K;
  const uniep::RoutingLayout cpu = uniep::compute_layout(topk_idx.data(), shape);
  DeviceArray<int64_t> d_per_rank(W), d_per_expert(E);
  DeviceArray<bool> d_in_rank(T * W);
  check(uniep::cuda::routing_layout(d_topk.ptr, T, K, E, W, d_per_rank.ptr, d_per_expert.ptr,
                                    d_in_rank.ptr, stream),
        "routing_layout");
  if (download(d_per_expert.ptr, E) != cpu.tokens_per_expert ||
      download(d_per_rank.ptr, W) != cpu.tokens_per_rank) {
    std::printf("FAILED: the device layout differs from uniep::compute_layout\n");
    return 1;
  }

  // ---- 2. the runtime: dispatch, identity experts, combine ----
  uniep::ep::Config config;
  config.max_tokens = T;
  config.hidden = H;
  config.top_k = K;
  config.num_experts = E;
  config.world_size = W;
  config.rank = 0;
  std::vector<uint8_t> unique_id;
  check(uniep::ep::make_unique_id(&unique_id), "make_unique_id");
  std::unique_ptr<uniep::ep::Runtime> runtime;
  check(uniep::ep::Runtime::create(config, unique_id, &runtime), "Runtime::create");

  uniep::ep::DispatchInput in;
  in.x = d_x.ptr;
  in.row_bytes = H * 2;
  in.topk_idx = d_topk.ptr;
  in.topk_weights = d_weights.ptr;
  in.tokens = T;
  in.num_sms = 8;
  uniep::ep::DispatchCounts counts;
  check(runtime->begin_dispatch(in, stream, &counts), "begin_dispatch");
  const uint64_t epoch = runtime->epoch();
  const int64_t N = counts.num_recv;
  const int64_t R =
      std::accumulate(counts.rows_per_expert.begin(), counts.rows_per_expert.end(), int64_t{0});

  DeviceArray<uint16_t> d_recv_x(N * H);
  DeviceArray<int64_t> d_recv_src(N), d_recv_topk(N * K), d_row_slot(R), d_row_target(R);
  DeviceArray<float> d_recv_weights(N * K);
  uniep::ep::DispatchOutput out;
  out.recv_x = d_recv_x.ptr;
  out.recv_src = d_recv_src.ptr;
  out.recv_topk_idx = d_recv_topk.ptr;
  out.recv_topk_weights = d_recv_weights.ptr;
  out.row_slot = d_row_slot.ptr;
  out.row_target = d_row_target.ptr;
  check(runtime->end_dispatch(out, stream), "end_dispatch");
  check_cuda(cudaStreamSynchronize(stream), "dispatch");

  // The planner's row lists for the same routing (one rank: slot s holds token s).
  const uniep::SlotPlan slots = uniep::plan_slots(cpu, cpu.tokens_per_rank.data(), shape);
  std::vector<int64_t> plan_src(slots.num_recv()), plan_topk(slots.num_recv() * K);
  for (int64_t s = 0; s < slots.num_recv(); ++s) {
    plan_src[s] = slots.send_tokens[s];
    for (int64_t k = 0; k < K; ++k) plan_topk[s * K + k] = topk_idx[plan_src[s] * K + k];
  }
  const uniep::ExpertPlan plan = uniep::plan_experts(slots, plan_src.data(), plan_topk.data(),
                                                     cpu.tokens_per_expert.data(), shape);
  const std::vector<int64_t> row_slot = download(d_row_slot.ptr, R);
  if (N != slots.num_recv() || download(d_recv_src.ptr, N) != plan_src ||
      row_slot != plan.row_slot) {
    std::printf("FAILED: the dispatch's slots or rows differ from the CPU planner's\n");
    return 1;
  }

  // Identity experts: grouped-GEMM row r is the received row it reads.
  const std::vector<uint16_t> recv_x = download(d_recv_x.ptr, N * H);
  std::vector<uint16_t> y(R * H);
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(&y[r * H], &recv_x[row_slot[r] * H], H * sizeof(uint16_t));
  }
  DeviceArray<uint16_t> d_y(R * H), d_out(T * H);
  upload(d_y, y);
  check(runtime->combine(d_y.ptr, d_row_target.ptr, R, d_topk.ptr, d_weights.ptr, T, in.num_sms,
                         uniep::CombineReduction::kPerChoice, d_out.ptr, epoch, stream),
        "combine");
  check(runtime->check_device_errors(stream), "check_device_errors");
  const std::vector<uint16_t> result = download(d_out.ptr, T * H);

  double max_err = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t n = 0; n < H; ++n) {
      float ref = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        if (topk_idx[t * K + k] >= 0) ref += topk_weights[t * K + k] * from_bf16(x[t * H + n]);
      }
      max_err = std::fmax(max_err, std::fabs(double(from_bf16(result[t * H + n])) - ref));
    }
  }
  runtime.reset();
  check_cuda(cudaStreamDestroy(stream), "cudaStreamDestroy");
  std::printf("dispatch + combine of %lld tokens on one GPU: max |error| %.3g\n",
              static_cast<long long>(T), max_err);
  if (max_err > 1e-2) {
    std::printf("FAILED: combine differs from sum_k w[t,k] * x[t]\n");
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
