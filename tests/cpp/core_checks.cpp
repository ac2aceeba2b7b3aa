// Edge cases of the uniep::core C++ API that once crashed, hung or answered wrong: each must now
// answer right or throw uniep::Error(kInvalidArgument) whose message names the argument (on
// every rank, for the executor's cases of two ranks as threads).
// tests/package/test_cpp_core_checks.py builds this against the installed CMake package and
// runs every case in its own process (a crash or a hang fails that case alone). Built from the
// sources under the sanitizers (from the repository root), it also catches what only ASan/UBSan
// see (collectives_without_shape):
//
//   g++ -std=c++17 -g -fsanitize=address,undefined -fno-sanitize-recover=all -I include -I cpp
//       tests/cpp/core_checks.cpp cpp/core/*.cpp cpp/core/parm/*.cpp cpp/core/collectives/*.cpp
//       -lpthread -o /tmp/core_checks && /tmp/core_checks
//
// Usage: core_checks [--list | CASE...]; with no argument every case runs. Prints "OK" last.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "uniep/collectives.hpp"
#include "uniep/cpu_executor.hpp"
#include "uniep/fp8_weights.hpp"
#include "uniep/parm.hpp"
#include "uniep/plan.hpp"
#include "uniep/status.hpp"

namespace {

using uniep::Error;
using uniep::MoeShape;
using uniep::StatusCode;

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

struct Failure {
  std::string what;
};

void require(bool cond, const std::string& what) {
  if (!cond) throw Failure{what};
}

// fn must throw uniep::Error(kInvalidArgument) whose message contains every one of `parts`.
void expect_invalid(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
  } catch (const Error& e) {
    require(e.code() == StatusCode::kInvalidArgument, std::string("code ") +
                                                          uniep::status_code_name(e.code()) +
                                                          ", want kInvalidArgument: " + e.what());
    for (const std::string& p : parts)
      require(std::strstr(e.what(), p.c_str()) != nullptr,
              "message \"" + std::string(e.what()) + "\" lacks \"" + p + "\"");
    return;
  } catch (const std::exception& e) {
    throw Failure{std::string("not a uniep::Error: ") + e.what()};
  }
  throw Failure{"returned; want uniep::Error naming \"" + parts.front() + "\""};
}

// Two ranks, two experts each, one token of top 2 on this rank.
MoeShape small_shape() {
  MoeShape s;
  s.tokens = 1;
  s.hidden = 8;
  s.ffn_hidden = 4;
  s.num_experts = 4;
  s.top_k = 2;
  s.world_size = 2;
  return s;
}

// plan_slots read rank_counts[rank * W + d] past its [W][W] end for rank == world_size.
void plan_slots_validates_shape() {
  MoeShape s = small_shape();
  const std::vector<int64_t> idx = {0, 1};
  const uniep::RoutingLayout layout = uniep::compute_layout(idx.data(), s);
  const std::vector<int64_t> counts = {1, 0, 0, 0};
  s.rank = 2;
  expect_invalid([&] { uniep::plan_slots(layout, counts.data(), s); },
                 {"rank must be in [0, 2), got 2"});
  // A peer's negative count would have made negative receive offsets.
  s.rank = 0;
  const std::vector<int64_t> bad = {1, 0, -5, 0};
  expect_invalid([&] { uniep::plan_slots(layout, bad.data(), s); },
                 {"rank_counts[1][0]", "got -5"});
  // And the right answer where all is well.
  const uniep::SlotPlan plan = uniep::plan_slots(layout, counts.data(), s);
  require(
      plan.num_send() == 1 && plan.send_tokens == std::vector<int64_t>{0} && plan.num_recv() == 1,
      "plan_slots on a valid shape");
}

// plan_sender_rows with fewer experts than ranks read ends[-1] (experts_per_rank() == 0).
void plan_sender_rows_validates_shape() {
  MoeShape s = small_shape();
  s.num_experts = 1;
  s.top_k = 1;
  const std::vector<int64_t> counts = {1, 0}, idx = {0};
  expect_invalid([&] { uniep::plan_sender_rows(idx.data(), counts.data(), s, 64); },
                 {"num_experts (1) must be divisible by the world size (2)"});
}

// plan_experts threw std::length_error for a negative announced count; the header says the counts
// are checked against a corrupt peer.
void plan_experts_checks_counts() {
  MoeShape s = small_shape();
  s.world_size = 1;
  uniep::SlotPlan sp;
  sp.world_size = 1;
  sp.send_offsets = {0, 0};
  sp.recv_offsets = {0, 0};
  const std::vector<int64_t> counts = {-3, 0, 0, 0};
  expect_invalid([&] { uniep::plan_experts(sp, nullptr, nullptr, counts.data(), s); },
                 {"expert_counts[0][0]", "got -3"});
  expect_invalid([&] { uniep::expert_source_offsets(counts.data(), s); },
                 {"expert_counts[0][0]", "got -3"});
  // Rows announced past what the received slots can hold: refused before anything is sized.
  const std::vector<int64_t> huge = {int64_t{1} << 30, 0, 0, 0};
  try {
    uniep::plan_experts(sp, nullptr, nullptr, huge.data(), s);
    throw Failure{"plan_experts accepted 2**30 announced rows with no receive slot"};
  } catch (const Error& e) {
    require(std::strstr(e.what(), "receive slots") != nullptr, e.what());
  }
}

// 8 ranks (2 nodes of 4 GPUs) in MP groups of 2: a layer every schedule can run.
uniep::parm::ParmShape small_parm_shape() {
  uniep::parm::ParmShape shape;
  shape.world_size = 8;
  shape.mp_size = 2;
  shape.gpus_per_node = 4;
  shape.tokens = 1024;
  shape.hidden = 256;
  shape.ffn_hidden = 512;
  shape.num_experts = 8;
  shape.top_k = 2;
  return shape;
}

// saa_seconds looped forever for max_chunks > 2**62: r *= 2 wrapped to a negative r.
void saa_huge_max_chunks() {
  using namespace uniep::parm;
  const AlphaBeta a{1e-5, 1e-9}, g{1e-5, 1e-9};
  int64_t r_max = 0, r_big = 0, r_16 = 0;
  const double t_max = saa_seconds(a, 1e8, g, 1e8, kInt64Max, &r_max);
  const double t_big = saa_seconds(a, 1e8, g, 1e8, int64_t{1} << 62, &r_big);
  const double t_16 = saa_seconds(a, 1e8, g, 1e8, 16, &r_16);
  require(t_max == t_big && r_max == r_big, "max_chunks INT64_MAX and 2**62 try the same degrees");
  require(t_16 >= t_max && r_16 >= 1 && r_16 <= 16, "max_chunks 16 tries at most 16 chunks");
  // price() and choose() take the same loop.
  const ParmShape shape = small_parm_shape();
  CostModel model = cost_model_from_cluster(ClusterSpec{}, rank_layout(8, 2, 4));
  model.max_chunks = int64_t{1} << 62;
  const Choice want = choose(shape, model);
  model.max_chunks = kInt64Max;
  const Choice got = choose(shape, model);
  for (int i = 0; i < 3; ++i)
    require(got.costs[i].total() == want.costs[i].total(), "choose with max_chunks INT64_MAX");
}

// The O(P^2) reference rank_layout used to be: every rank's groups, listed.
uniep::parm::RankLayout reference_layout(int64_t P, int64_t N, int64_t per_node) {
  using namespace uniep::parm;
  RankLayout l;
  l.world_size = P;
  l.mp_size = N;
  l.ep_size = P / N;
  l.gpus_per_node = per_node;
  auto link = [&](const std::vector<int64_t>& ranks) {
    if (ranks.size() == 1) return LinkClass::kLocal;
    for (int64_t r : ranks)
      if (l.node_of(r) != l.node_of(ranks[0])) return LinkClass::kInter;
    return LinkClass::kIntra;
  };
  auto worse = [](LinkClass a, LinkClass b) {
    return static_cast<int>(a) > static_cast<int>(b) ? a : b;
  };
  std::vector<int64_t> all;
  for (int64_t r = 0; r < P; ++r) {
    all.push_back(r);
    l.mp_link = worse(l.mp_link, link(l.mp_group(r)));
    l.ep_link = worse(l.ep_link, link(l.ep_group(r)));
    int64_t intra = 0, inter = 0;
    for (int64_t p : l.ep_group(r))
      if (p != r) (l.node_of(p) == l.node_of(r) ? intra : inter) += 1;
    l.ep_peers_intra = std::max(l.ep_peers_intra, intra);
    l.ep_peers_inter = std::max(l.ep_peers_inter, inter);
  }
  l.world_link = link(all);
  return l;
}

// rank_layout listed every rank's EP group: 6.5 s at 16384 ranks. Same answers, in linear time.
void rank_layout_linear() {
  using namespace uniep::parm;
  for (int64_t P : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48})
    for (int64_t N = 1; N <= P; ++N) {
      if (P % N != 0) continue;
      for (int64_t per_node : {1, 2, 3, 4, 5, 8, 64}) {
        const RankLayout got = rank_layout(P, N, per_node), want = reference_layout(P, N, per_node);
        const std::string at = "rank_layout(" + std::to_string(P) + ", " + std::to_string(N) +
                               ", " + std::to_string(per_node) + ")";
        require(got.mp_link == want.mp_link && got.ep_link == want.ep_link &&
                    got.world_link == want.world_link,
                at + ": link classes differ from the reference");
        require(
            got.ep_peers_intra == want.ep_peers_intra && got.ep_peers_inter == want.ep_peers_inter,
            at + ": EP peer counts differ from the reference");
        require(got.nodes == (P + per_node - 1) / per_node && got.ep_size == P / N, at + ": sizes");
      }
    }
  const auto t0 = std::chrono::steady_clock::now();
  const RankLayout big = rank_layout(16384, 1, 8);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  require(big.ep_peers_intra == 7 && big.ep_peers_inter == 16384 - 8 &&
              big.ep_link == LinkClass::kInter,
          "rank_layout(16384, 1, 8) peers");
  require(s < 1.0, "rank_layout(16384, 1, 8) took " + std::to_string(s) + " s");
}

// gate_tile_base formed end - begin + tile_m - 1, which wraps for a tile_m near INT64_MAX.
void gate_tile_base_huge_tile_m() {
  const std::vector<int32_t> offs = {5, 10, 10, 23};
  const std::vector<int32_t> one_tile = {0, 1, 2, 2, 3};
  for (int64_t tm : {int64_t{13}, int64_t{1} << 31, int64_t{1} << 62, kInt64Max})
    require(uniep::gate_tile_base(offs.data(), 4, 23, tm) == one_tile,
            "gate_tile_base with tile_m " + std::to_string(tm) + ": want 0,1,2,2,3");
  require(uniep::gate_tile_base(offs.data(), 4, 23, 4) == std::vector<int32_t>({0, 2, 4, 4, 8}),
          "gate_tile_base with tile_m 4: want 0,2,4,4,8");
  // And in the tile schedule: a negative tile_m stepped backwards without end.
  MoeShape s = small_shape();
  s.world_size = 1;
  uniep::ExpertPlan plan;
  plan.num_local_experts = 4;
  plan.row_offsets.assign(5, 0);
  uniep::TuningParams tuning;
  tuning.tile_m = -16;
  const std::vector<int64_t> source_offsets(8, 0);
  expect_invalid([&] { uniep::schedule_expert_tiles(plan, source_offsets, tuning, s); },
                 {"tile_m must be >= 1", "got -16"});
}

// tokens * world_size wrapped (2**48 * 2**16 == 0 mod 2**64): compute_layout wrote through an
// empty [T, W] array.
void layout_tokens_bound() {
  MoeShape s;
  s.tokens = int64_t{1} << 48;
  s.hidden = 1;
  s.ffn_hidden = 1;
  s.num_experts = 1 << 16;
  s.top_k = 1;
  s.world_size = 1 << 16;
  const std::vector<int64_t> idx = {0};
  expect_invalid([&] { uniep::compute_layout(idx.data(), s); },
                 {"tokens must be <= 4294967296", "got 281474976710656"});
  s.tokens = 1;
  s.top_k = int64_t{1} << 62;  // tokens * top_k entries would wrap the same way
  expect_invalid([&] { uniep::compute_layout(idx.data(), s); },
                 {"top_k must be <= 1048576", "got 4611686018427387904"});
}

// price() indexed steps[overlap_with] unchecked.
void price_checks_overlap_with() {
  using namespace uniep::parm;
  const ParmShape shape = small_parm_shape();
  const StepList good = build_steps(shape, Schedule::kS2, Pass::kForward);
  const CostModel model = cost_model_from_cluster(ClusterSpec{}, good.layout);
  require(price(good, model).seconds > 0, "price of a valid step list");
  StepList bad = good;
  bad.steps[0].overlap_with = 999;
  expect_invalid([&] { price(bad, model); }, {"steps[0].overlap_with", "got 999"});
  bad = good;
  bad.steps[0].overlap_with = -7;
  expect_invalid([&] { price(bad, model); }, {"steps[0].overlap_with", "got -7"});
  // One-sided: step 0 names step 1, which names nothing (it would be priced twice).
  bad = good;
  for (Step& st : bad.steps) st.overlap_with = -1;
  bad.steps[0].overlap_with = 1;
  expect_invalid([&] { price(bad, model); }, {"steps[1].overlap_with is -1"});
}

// An all-gather GEMM agrees on no shape: &shapes[r * 0] indexed an empty vector (UBSan's
// complaint; the answer was right). Caught by the sanitized build.
void collectives_without_shape() {
  uniep::LocalPeerTransport tr;
  const std::vector<float> a = {1, 2, 3, 4}, b = {1, 0, 0, 1};  // a [2, 2], b = I
  std::vector<float> gathered(4, -1), out(4, -1);
  uniep::AllGatherArgs args;
  args.a = a.data();
  args.b = b.data();
  args.gathered = gathered.data();
  args.out = out.data();
  args.dtype = uniep::DType::kFloat32;
  args.rows_per_rank = 2;
  args.k = 2;
  args.n = 2;
  uniep::cpu_all_gather(uniep::CollectiveKind::kAllGatherMatmul, args, tr);
  require(gathered == a && out == a, "all_gather_matmul on one rank: out = a @ I");
}

// Ranks as threads of one process: every collective waits until all have posted, or for 5 s.
class ThreadRanks {
 public:
  using Chunks = std::vector<std::vector<uint8_t>>;  // one byte range per destination rank
  explicit ThreadRanks(int64_t world) : world_(world), posted_(world) {}
  class Rank final : public uniep::Transport {
   public:
    Rank(ThreadRanks& all, int64_t rank) : all_(all), rank_(rank) {}
    int64_t rank() const override { return rank_; }
    int64_t world_size() const override { return all_.world_; }
    void all_gather(const int64_t* in, int64_t n, int64_t* out) override {
      const auto* bytes = reinterpret_cast<const uint8_t*>(in);
      const std::vector<Chunks> all =
          all_.exchange(rank_, Chunks(all_.world_, std::vector<uint8_t>(bytes, bytes + n * 8)));
      for (int64_t r = 0; r < all_.world_; ++r) {
        require(static_cast<int64_t>(all[r][rank_].size()) == n * 8,
                "all_gather: rank " + std::to_string(r) + " sent another size");
        std::memcpy(out + r * n, all[r][rank_].data(), n * 8);
      }
    }
    void all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes, uint8_t* recv,
                    const std::vector<int64_t>& recv_bytes) override {
      Chunks mine;
      for (int64_t r = 0, at = 0; r < all_.world_; at += send_bytes[r++])
        mine.emplace_back(send + at, send + at + send_bytes[r]);
      const std::vector<Chunks> all = all_.exchange(rank_, std::move(mine));
      for (int64_t r = 0, at = 0; r < all_.world_; at += recv_bytes[r++]) {
        require(static_cast<int64_t>(all[r][rank_].size()) == recv_bytes[r],
                "all_to_all: rank " + std::to_string(r) + " sent another size");
        std::memcpy(recv + at, all[r][rank_].data(), recv_bytes[r]);
      }
    }

   private:
    ThreadRanks& all_;
    int64_t rank_;
  };

 private:
  // Round by round: each rank posts its chunks, and every rank reads all of them.
  std::vector<Chunks> exchange(int64_t rank, Chunks mine) {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t round = round_;
    posted_[rank] = std::move(mine);
    if (++arrived_ == world_) {
      result_ = posted_;
      arrived_ = 0;
      ++round_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, std::chrono::seconds(5), [&] { return round_ != round; })) {
      throw Failure{"rank " + std::to_string(rank) + " waited 5 s for its peers"};
    }
    return result_;
  }
  int64_t world_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t arrived_ = 0, round_ = 0;
  std::vector<Chunks> posted_, result_;
};

// Two ranks call cpu_moe_forward (or its backward); `spoil(args, rank)` changes their arguments.
// Returns each rank's error message ("" where it returned).
using Spoil = std::function<void(uniep::MoeForwardArgs&, int64_t)>;
std::vector<std::string> two_ranks(const Spoil& spoil, bool backward = false) {
  constexpr int64_t T = 2, H = 128, I = 128, E = 4, K = 2, W = 2;
  ThreadRanks ranks(W);
  auto run = [&](int64_t r) -> std::string {
    std::vector<float> x(T * H, 0.5f), tw(T * K, 0.5f), out(T * H);
    std::vector<float> w1(E / W * H * 2 * I, 0.01f), w2(E / W * I * H, 0.01f);
    std::vector<float> gx(T * H), gtw(T * K), gw1(w1.size()), gw2(w2.size());
    const std::vector<int64_t> idx = {0, 2, 1, 3};
    ThreadRanks::Rank tr(ranks, r);
    uniep::MoeForwardArgs a;
    a.x = x.data();
    a.topk_idx = idx.data();
    a.topk_weights = tw.data();
    a.w1 = w1.data();
    a.w2 = w2.data();
    a.out = out.data();
    a.shape.tokens = T;
    a.shape.hidden = H;
    a.shape.ffn_hidden = I;
    a.shape.num_experts = E;
    a.shape.top_k = K;
    a.shape.world_size = W;
    a.shape.rank = r;
    spoil(a, r);
    try {
      if (backward) {
        uniep::MoeBackwardArgs b;
        b.fwd = a;
        b.grad_out = x.data();
        b.grad_x = gx.data();
        b.grad_topk_weights = gtw.data();
        b.grad_w1 = gw1.data();
        b.grad_w2 = gw2.data();
        uniep::cpu_moe_backward(b, tr);
      } else {
        uniep::cpu_moe_forward(a, tr);
      }
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  std::future<std::string> other = std::async(std::launch::async, run, 1);
  std::vector<std::string> got = {run(0)};
  got.push_back(other.get());
  return got;
}

void expect_both(const std::vector<std::string>& got, const std::string& rank0,
                 const std::string& rank1) {
  for (int64_t r = 0; r < 2; ++r) {
    const std::string& want = r == 0 ? rank0 : rank1;
    require(got[r].find(want) != std::string::npos,
            "rank " + std::to_string(r) + ": \"" + got[r] + "\" lacks \"" + want + "\"");
  }
}

// One rank's bad argument failed there alone and left its peer waiting in the plan's exchange.
void executor_shares_a_failed_check() {
  using Args = uniep::MoeForwardArgs;
  const std::string peer = "rank 1 failed its argument checks";
  expect_both(two_ranks([](Args& a, int64_t r) { a.tuning.token_tile = r == 1 ? 0 : 64; }), peer,
              "token_tile must be in [1, 4096], got 0");
  expect_both(two_ranks([](Args& a, int64_t r) { a.shape.tokens = r == 1 ? -1 : 2; }), peer,
              "tokens must be >= 0, got -1");
  expect_both(two_ranks([](Args& a, int64_t r) { a.x = r == 1 ? nullptr : a.x; }), peer,
              "x must not be null");
  expect_both(
      two_ranks([](Args& a, int64_t r) { a.dtype = r == 1 ? uniep::DType(3) : a.dtype; }, true),
      peer, "dtype must be float32, bfloat16 or float64, got value 3");
  const std::vector<std::string> fine = two_ranks([](Args&, int64_t) {});
  require(fine[0].empty() && fine[1].empty(), "good arguments raised: " + fine[0] + fine[1]);
}

// Ranks whose experts ran in other precisions computed on, each with its own bits.
void executor_agrees_on_the_experts_precision() {
  const std::string want = "tuning experts (fp8 GEMMs) differs across ranks";
  expect_both(two_ranks([](uniep::MoeForwardArgs& a, int64_t r) {
                a.tuning = uniep::TuningParams::parse(r == 0 ? "dispatch=fp8"
                                                             : "dispatch=fp8,experts=bf16");
              }),
              want, want);
}

// The host fp8 weights a C++ server makes: values, layout, and a named error for each bad size.
void fp8_weights_layout_and_errors() {
  // One expert, K 128 x N 256: block 0 holds 2.0, -1.0 and zeros (amax 2), block 1 only zeros.
  constexpr int64_t K = 128, N = 256;
  std::vector<uint16_t> w(K * N, 0);
  w[0 * N + 0] = 0x4000;  // 2.0 at [k 0, n 0]
  w[5 * N + 7] = 0xbf80;  // -1.0 at [k 5, n 7]
  std::vector<uint8_t> q(N * K, 0xff);
  std::vector<float> scales(2, -1.0f);
  uniep::quantize_expert_weights_fp8(w.data(), 1, K, N, q.data(), scales.data());
  require(scales[0] == 2.0f / 448.0f && scales[1] == 1.0f,
          "scales " + std::to_string(scales[0]) + ", " + std::to_string(scales[1]));
  // K-major: q[n][k]. 2.0 -> 448 (0x7e); -1.0 -> -224 = -1.75 x 2^7 (0xf6); zeros stay 0.
  require(q[0 * K + 0] == 0x7e && q[7 * K + 5] == 0xf6 && q[7 * K + 4] == 0 && q[200 * K + 3] == 0,
          "e4m3 codes " + std::to_string(q[0]) + ", " + std::to_string(q[7 * K + 5]));

  // Packing: ffn 128 (two 64-row gate blocks, then two up blocks), K 128, two experts.
  constexpr int64_t F = 128, E = 2, R = 2 * F;
  const int64_t want_rows[] = {0, 63, 128, 191, 64, 127, 192, 255};
  const int64_t packed_rows[] = {0, 63, 64, 127, 128, 191, 192, 255};
  for (int i = 0; i < 8; ++i)
    require(uniep::gate_up_source_row(packed_rows[i], F) == want_rows[i],
            "packed row " + std::to_string(packed_rows[i]));
  std::vector<uint8_t> q1(E * R * K), qp(E * R * K);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) q1[(e * R + r) * K + k] = static_cast<uint8_t>(r + e + k);
  std::vector<float> s1 = {1, 2, 3, 4}, sp(E * R / 64, 0.0f);  // [E][1][2]: the 128-row blocks
  uniep::pack_gate_up_fp8(q1.data(), s1.data(), E, F, K, qp.data(), sp.data());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t p = 0; p < R; ++p) {
      const int64_t src = uniep::gate_up_source_row(p, F);
      require(std::memcmp(&qp[(e * R + p) * K], &q1[(e * R + src) * K], K) == 0,
              "expert " + std::to_string(e) + " packed row " + std::to_string(p));
    }
  // Groups (gate 0, up 0, gate 1, up 1) of blocks (0, 1, 0, 1) for each expert.
  const std::vector<float> want_s = {1, 2, 1, 2, 3, 4, 3, 4};
  require(sp == want_s, "packed scales");

  expect_invalid(
      [&] { uniep::quantize_expert_weights_fp8(w.data(), 1, 100, N, q.data(), scales.data()); },
      {"k must be a positive multiple of 128", "got 100"});
  expect_invalid(
      [&] { uniep::quantize_expert_weights_fp8(nullptr, 1, K, N, q.data(), scales.data()); },
      {"w, q and scales must not be null", "w null"});
  expect_invalid([&] { uniep::gate_up_source_row(0, 96); },
                 {"ffn must be a positive multiple of 64", "96"});
  expect_invalid([&] { uniep::gate_up_source_row(2 * F, F); },
                 {"packed_row must be in [0, 2 ffn = 256)"});
  expect_invalid(
      [&] { uniep::pack_gate_up_fp8(q1.data(), s1.data(), E, F, 64, qp.data(), sp.data()); },
      {"k must be a positive multiple of 128", "got 64"});
  expect_invalid(
      [&] { uniep::pack_gate_up_fp8(q1.data(), s1.data(), -1, F, K, qp.data(), sp.data()); },
      {"experts must be in [0, "});
}

struct Case {
  const char* name;
  void (*fn)();
};
const Case kCases[] = {
    {"plan_slots_validates_shape", plan_slots_validates_shape},
    {"plan_sender_rows_validates_shape", plan_sender_rows_validates_shape},
    {"plan_experts_checks_counts", plan_experts_checks_counts},
    {"saa_huge_max_chunks", saa_huge_max_chunks},
    {"rank_layout_linear", rank_layout_linear},
    {"gate_tile_base_huge_tile_m", gate_tile_base_huge_tile_m},
    {"layout_tokens_bound", layout_tokens_bound},
    {"price_checks_overlap_with", price_checks_overlap_with},
    {"collectives_without_shape", collectives_without_shape},
    {"executor_shares_a_failed_check", executor_shares_a_failed_check},
    {"executor_agrees_on_the_experts_precision", executor_agrees_on_the_experts_precision},
    {"fp8_weights_layout_and_errors", fp8_weights_layout_and_errors},
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> wanted(argv + 1, argv + argc);
  if (wanted.size() == 1 && wanted[0] == "--list") {
    for (const Case& c : kCases) std::printf("%s\n", c.name);
    return 0;
  }
  int failed = 0, ran = 0;
  for (const Case& c : kCases) {
    bool chosen = wanted.empty();
    for (const std::string& w : wanted) chosen = chosen || w == c.name;
    if (!chosen) continue;
    ++ran;
    std::printf("%s ... ", c.name);
    std::fflush(stdout);
    try {
      c.fn();
      std::printf("ok\n");
    } catch (const Failure& f) {
      std::printf("FAILED: %s\n", f.what.c_str());
      ++failed;
    } catch (const std::exception& e) {
      std::printf("FAILED: unexpected exception: %s\n", e.what());
      ++failed;
    }
    std::fflush(stdout);
  }
  if (ran !=
      static_cast<int>(wanted.empty() ? sizeof(kCases) / sizeof(kCases[0]) : wanted.size())) {
    std::printf("FAILED: unknown case name among the arguments (--list names them)\n");
    return 2;
  }
  if (failed) {
    std::printf("%d of %d FAILED\n", failed, ran);
    return 1;
  }
  std::printf("OK\n");
  return 0;
}
