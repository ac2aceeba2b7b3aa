// ParmShape checks, the capacity rule, the rank layout and the names of the enums.
#include <algorithm>
#include <cmath>

#include "uniep/parm.hpp"
#include "uniep/status.hpp"

namespace uniep::parm {

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::kBaseline:
      return "baseline";
    case Schedule::kS1:
      return "s1";
    case Schedule::kS2:
      return "s2";
  }
  return "?";
}

const char* pass_name(Pass p) {
  return p == Pass::kForward ? "forward" : "backward";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kGate:
      return "gate";
    case Op::kOrder:
      return "order";
    case Op::kExpert:
      return "expert";
    case Op::kIOrder:
      return "iorder";
    case Op::kGateBwd:
      return "gate_bwd";
    case Op::kOrderBwd:
      return "order_bwd";
    case Op::kExpertBwd:
      return "expert_bwd";
    case Op::kIOrderBwd:
      return "iorder_bwd";
    case Op::kMpSplitTokens:
      return "mp_split_tokens";
    case Op::kMpSplitCapacity:
      return "mp_split_capacity";
    case Op::kMpAllGatherTokens:
      return "mp_all_gather_tokens";
    case Op::kMpAllGatherCapacity:
      return "mp_all_gather_capacity";
    case Op::kEpAllToAllDispatch:
      return "ep_all_to_all_dispatch";
    case Op::kEpAllToAllCombine:
      return "ep_all_to_all_combine";
    case Op::kEspAllGather:
      return "esp_all_gather";
    case Op::kEspReduceScatter:
      return "esp_reduce_scatter";
    case Op::kEspAllReduce:
      return "esp_all_reduce";
    case Op::kMpAllReduceStats:
      return "mp_all_reduce_stats";
    case Op::kWorldAgreeRouting:
      return "world_agree_routing";
    case Op::kMpAllReduceGateGrad:
      return "mp_all_reduce_gate_grad";
  }
  return "?";
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::kNone:
      return "none";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kAllToAll:
      return "all_to_all";
  }
  return "?";
}

const char* link_class_name(LinkClass l) {
  switch (l) {
    case LinkClass::kLocal:
      return "local";
    case LinkClass::kIntra:
      return "intra";
    case LinkClass::kInter:
      return "inter";
  }
  return "?";
}

const char* group_name(Group g) {
  switch (g) {
    case Group::kNone:
      return "none";
    case Group::kMp:
      return "mp";
    case Group::kEp:
      return "ep";
    case Group::kWorld:
      return "world";
  }
  return "?";
}

Schedule parse_schedule(const std::string& text) {
  if (text == "baseline") return Schedule::kBaseline;
  if (text == "s1") return Schedule::kS1;
  if (text == "s2") return Schedule::kS2;
  throw Error(StatusCode::kInvalidArgument,
              "schedule must be 'baseline', 's1' or 's2', got '" + text + "'");
}

int collective_index(Collective c) {
  UNIEP_CHECK(c != Collective::kNone, "collective: kNone has no cost-model index");
  return static_cast<int>(c) - 1;
}

void ParmShape::validate() const {
  UNIEP_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  UNIEP_CHECK(mp_size >= 1 && world_size % mp_size == 0,
              "mp_size must be >= 1 and divide world_size ", world_size, ", got ", mp_size);
  UNIEP_CHECK(gpus_per_node >= 1, "gpus_per_node must be >= 1, got ", gpus_per_node);
  UNIEP_CHECK(tokens >= 1, "tokens must be >= 1, got ", tokens);
  UNIEP_CHECK(hidden >= 1, "hidden must be >= 1, got ", hidden);
  UNIEP_CHECK(ffn_hidden >= 1 && ffn_hidden % mp_size == 0,
              "ffn_hidden must be >= 1 and divisible by mp_size ", mp_size,
              " (each ESP rank holds ", "H / N of every local expert), got ", ffn_hidden);
  UNIEP_CHECK(num_experts >= 1 && num_experts % ep_size() == 0,
              "num_experts must be >= 1 and divisible by the EP size world_size / mp_size = ",
              ep_size(), ", got ", num_experts);
  UNIEP_CHECK(top_k >= 1 && top_k <= num_experts,
              "top_k must be in [1, num_experts = ", num_experts, "], got ", top_k);
  UNIEP_CHECK(std::isfinite(capacity_factor), "capacity_factor must be finite, got ",
              capacity_factor);
  UNIEP_CHECK(dtype_bytes >= 1 && dtype_bytes <= 8, "dtype_bytes must be in [1, 8], got ",
              dtype_bytes);
}

int64_t ParmShape::slice_tokens(int64_t m) const {
  UNIEP_CHECK(m >= 0 && m < mp_size, "slice index must be in [0, ", mp_size, "), got ", m);
  // The first S % N slices take one token more: the same split torch.tensor_split makes.
  return tokens / mp_size + (m < tokens % mp_size ? 1 : 0);
}

int64_t ParmShape::slice_capacity() const {
  if (capacity_factor <= 0) return max_slice_tokens();
  const double want = top_k * capacity_factor * static_cast<double>(tokens) /
                      static_cast<double>(num_experts * mp_size);
  // The epsilon keeps 1.2 * 10 / 12 (= 1.0000000000000002 in binary) from rounding up to 2.
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(want - 1e-9)));
}

int64_t ParmShape::dispatch_bytes() const {
  return num_experts * capacity() * hidden * dtype_bytes;
}

std::vector<int64_t> RankLayout::mp_group(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t m = 0; m < mp_size; ++m) out.push_back(ep_index(rank) * mp_size + m);
  return out;
}

std::vector<int64_t> RankLayout::ep_group(int64_t rank) const {
  std::vector<int64_t> out;
  for (int64_t g = 0; g < ep_size; ++g) out.push_back(g * mp_size + mp_index(rank));
  return out;
}

int64_t RankLayout::first_expert(int64_t rank, int64_t num_experts) const {
  return ep_index(rank) * (num_experts / ep_size);
}

RankLayout rank_layout(int64_t world_size, int64_t mp_size, int64_t gpus_per_node) {
  UNIEP_CHECK(world_size >= 1, "world_size must be >= 1, got ", world_size);
  UNIEP_CHECK(mp_size >= 1 && world_size % mp_size == 0,
              "mp_size must be >= 1 and divide world_size ", world_size, ", got ", mp_size);
  UNIEP_CHECK(gpus_per_node >= 1, "gpus_per_node must be >= 1, got ", gpus_per_node);
  RankLayout l;
  l.world_size = world_size;
  l.mp_size = mp_size;
  l.ep_size = world_size / mp_size;
  l.gpus_per_node = gpus_per_node;
  l.nodes = (world_size + gpus_per_node - 1) / gpus_per_node;
  // A group's ranks ascend and node_of never decreases with the rank, so a group is on one node
  // exactly when its first and last ranks are; and the peers of a rank on its own node are the
  // other members of its run of equal nodes. That keeps the layout O(P) where listing every
  // rank's groups was O(P^2) (seconds at 16384 ranks).
  auto group_link = [&](int64_t first, int64_t last) {
    if (first == last) return LinkClass::kLocal;
    return l.node_of(first) == l.node_of(last) ? LinkClass::kIntra : LinkClass::kInter;
  };
  // The class of a group kind is that of its worst instance: collectives run in lockstep.
  auto worse = [](LinkClass a, LinkClass b) {
    return static_cast<int>(a) > static_cast<int>(b) ? a : b;
  };
  const int64_t N = l.mp_size, G = l.ep_size;
  for (int64_t g = 0; g < G; ++g) l.mp_link = worse(l.mp_link, group_link(g * N, g * N + N - 1));
  for (int64_t m = 0; m < N; ++m) {
    // EP group m: ranks m, m + N, ..., m + (G - 1) N.
    l.ep_link = worse(l.ep_link, group_link(m, m + (G - 1) * N));
    for (int64_t g = 0; g < G;) {
      int64_t end = g + 1;
      while (end < G && l.node_of(end * N + m) == l.node_of(g * N + m)) ++end;
      const int64_t on_node = end - g;  // every member of this run sees the same counts
      l.ep_peers_intra = std::max(l.ep_peers_intra, on_node - 1);
      l.ep_peers_inter = std::max(l.ep_peers_inter, G - on_node);
      g = end;
    }
  }
  l.world_link = group_link(0, world_size - 1);
  return l;
}

}  // namespace uniep::parm
