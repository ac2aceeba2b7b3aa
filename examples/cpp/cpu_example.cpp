// UniEP from C++ without a GPU: plan the routing of a small MoE layer on one rank with the public
// planner, run the CPU executor on it, and check both against plain loops written for clarity.
// Prints OK and exits 0, or names the first mismatch and exits 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <uniep/cpu_executor.hpp>
#include <uniep/plan.hpp>
#include <uniep/status.hpp>
#include <uniep/tuning.hpp>
#include <uniep/version.hpp>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("MISMATCH: %s\n", what.c_str());
    ++failures;
  }
}

double silu(double a) {
  return a / (1.0 + std::exp(-a));
}

}  // namespace

int main() {
  std::printf("uniep %s (headers %d.%d.%d)\n", UNIEP_VERSION_STRING, UNIEP_VERSION_MAJOR,
              UNIEP_VERSION_MINOR, UNIEP_VERSION_PATCH);

  uniep::MoeShape shape;
  shape.tokens = 6;
  shape.hidden = 16;
  shape.ffn_hidden = 8;
  shape.num_experts = 4;
  shape.top_k = 2;
  shape.validate();
  const int64_t T = shape.tokens, H = shape.hidden, I = shape.ffn_hidden;
  const int64_t E = shape.num_experts, K = shape.top_k;

  // Token 4 uses one expert only (-1 marks an unused choice); token 5 repeats the pattern of 1.
  const std::vector<int64_t> topk_idx = {0, 1, 2, 3, 3, 0, 1, 2, 2, -1, 2, 3};
  const std::vector<float> topk_weights = {0.75f, 0.25f, 0.5f, 0.5f, 0.9f, 0.1f,
                                           0.6f,  0.4f,  1.0f, 0.0f, 0.3f, 0.7f};

  // The tuning string round-trips; no tuning point changes the output bits.
  const uniep::TuningParams tuning = uniep::TuningParams::parse("overlap=sequential,token_tile=4");
  expect(uniep::TuningParams::parse(tuning.to_string()) == tuning, "TuningParams round trip");
  // It knows which keys were given (the MegaKernel runs only where overlap=fused is named).
  expect(tuning.given(uniep::TuningKey::kOverlap) && !tuning.given(uniep::TuningKey::kSms),
         "TuningParams given keys");
  expect(tuning.to_string(/*given_only=*/true) == "token_tile=4,overlap=sequential",
         "TuningParams given form");

  // ---- the plan ----
  const uniep::RoutingLayout layout = uniep::compute_layout(topk_idx.data(), shape);
  for (int64_t e = 0; e < E; ++e) {
    int64_t pairs = 0;
    for (int64_t i = 0; i < T * K; ++i) pairs += topk_idx[i] == e;
    expect(layout.tokens_per_expert[e] == pairs, "tokens_per_expert[" + std::to_string(e) + "]");
  }
  expect(layout.tokens_per_rank[0] == T, "tokens_per_rank[0]");

  // One rank: the all-gathered counts are this rank's own, every token lands in the slot of its
  // index, and the received metadata is the sender's routing.
  const uniep::SlotPlan slots = uniep::plan_slots(layout, layout.tokens_per_rank.data(), shape);
  expect(slots.num_send() == T && slots.num_recv() == T, "one receive slot per token");
  for (int64_t i = 0; i < slots.num_send(); ++i) {
    expect(slots.send_tokens[i] == i && slots.send_slots[i] == i,
           "slot of token " + std::to_string(i));
  }
  std::vector<int64_t> recv_src(slots.num_recv()), recv_topk(slots.num_recv() * K);
  for (int64_t s = 0; s < slots.num_recv(); ++s) {
    recv_src[s] = slots.send_tokens[s];
    for (int64_t k = 0; k < K; ++k) recv_topk[s * K + k] = topk_idx[recv_src[s] * K + k];
  }
  const uniep::ExpertPlan experts = uniep::plan_experts(slots, recv_src.data(), recv_topk.data(),
                                                        layout.tokens_per_expert.data(), shape);
  // Each expert's grouped-GEMM rows: its (token, k) pairs in token order, then k order.
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    expect(experts.row_offsets[e] == row, "row_offsets[" + std::to_string(e) + "]");
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < K; ++k) {
        if (topk_idx[t * K + k] != e) continue;
        expect(row < experts.num_rows() && experts.row_slot[row] == t &&
                   experts.row_combine_slot[row] == t * K + k,
               "row " + std::to_string(row) + " of expert " + std::to_string(e));
        ++row;
      }
    }
  }
  expect(experts.num_rows() == row, "number of expert rows");

  // ---- the CPU executor ----
  std::vector<float> x(T * H), w1(E * H * 2 * I), w2(E * I * H), out(T * H, NAN);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37 * double(i));
  for (size_t i = 0; i < w1.size(); ++i) w1[i] = std::cos(0.11 * double(i)) * 0.5;
  for (size_t i = 0; i < w2.size(); ++i) w2[i] = std::sin(0.23 * double(i) + 1.0) * 0.5;

  uniep::MoeForwardArgs args;
  args.x = x.data();
  args.topk_idx = topk_idx.data();
  args.topk_weights = topk_weights.data();
  args.w1 = w1.data();
  args.w2 = w2.data();
  args.out = out.data();
  args.dtype = uniep::DType::kFloat32;
  args.weight_dtype = uniep::DType::kFloat32;
  args.shape = shape;
  args.tuning = tuning;
  uniep::LocalTransport transport;
  uniep::cpu_moe_forward(args, transport);

  // y[t] = sum_k w[t,k] * (silu(x W1g) * (x W1u)) W2 of expert topk_idx[t,k], in double.
  double max_err = 0.0, max_ref = 0.0;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> y(H, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = topk_idx[t * K + k];
      if (e < 0) continue;
      std::vector<double> h(I);
      for (int64_t j = 0; j < I; ++j) {
        double gate = 0.0, up = 0.0;
        for (int64_t n = 0; n < H; ++n) {
          gate += double(x[t * H + n]) * w1[(e * H + n) * 2 * I + j];
          up += double(x[t * H + n]) * w1[(e * H + n) * 2 * I + I + j];
        }
        h[j] = silu(gate) * up;
      }
      for (int64_t n = 0; n < H; ++n) {
        double acc = 0.0;
        for (int64_t j = 0; j < I; ++j) acc += h[j] * w2[(e * I + j) * H + n];
        y[n] += double(topk_weights[t * K + k]) * acc;
      }
    }
    for (int64_t n = 0; n < H; ++n) {
      max_err = std::fmax(max_err, std::fabs(double(out[t * H + n]) - y[n]));
      max_ref = std::fmax(max_ref, std::fabs(y[n]));
    }
  }
  std::printf("cpu_moe_forward: max |error| %.3g of max |y| %.3g\n", max_err, max_ref);
  expect(max_err <= 1e-5 * max_ref, "cpu_moe_forward against the float64 loop");

  // Bad input is an exception naming the argument, never a silent drop.
  try {
    const std::vector<int64_t> bad = {0, 1, 2, 7, 3, 0, 1, 2, 2, -1, 2, 3};
    uniep::compute_layout(bad.data(), shape);
    expect(false, "an expert id outside [-1, E) was accepted");
  } catch (const uniep::Error& error) {
    expect(error.code() == uniep::StatusCode::kInvalidArgument, "bad expert id: status code");
    std::printf("bad routing rejected: %s\n", error.what());
  }

  if (failures != 0) {
    std::printf("FAILED (%d mismatches)\n", failures);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
