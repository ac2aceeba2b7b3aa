// Parm (arXiv 2407.00599): the schedules of an MoE layer under MP+EP+ESP training, as explicit
// step lists, and the alpha-beta cost model that prices them. docs/parm.md says which parts follow
// the paper, DeepSpeed-MoE or the authors' released kernel, and which are reconstructions.
//
// ---- Rank layout ----
// P ranks, N = MP = ESP group size, G = P / N. Rank r has MP index m = r % N and EP index
// g = r / N. The MP group of r is the N consecutive ranks [g*N, (g+1)*N) (they hold the same
// tokens, replicated, like a tensor-parallel block's output); the EP group of r is the G ranks
// {m, m+N, ...}. MP group g owns experts [g*E_loc, (g+1)*E_loc), E_loc = E / G, and its rank m
// holds shard m of each: W1[:, m*H/N : (m+1)*H/N] and W2[m*H/N : (m+1)*H/N, :].
//
// ---- Capacity (the same in every schedule, so that overflow is too) ----
// The S tokens of an MP group are cut into N contiguous slices (sizes differ by at most one; slice
// m is what S1 keeps on MP rank m). Each (slice, expert) pair has c = slice_capacity() slots, so
// an expert takes T = N*c rows per MP group: slots [m*c, (m+1)*c) hold slice m's tokens. Within a
// slice, slots go to the (token, choice) pairs in choice-major, token-minor order (GShard: all
// first choices before any second choice). A pair that finds its slice's c slots full overflows:
// an error, or dropped and counted when the caller asked for dropping. Because the slot of a pair
// depends only on its own slice, S1 (which routes one slice per rank) and the baseline and S2
// (which route all S tokens on every MP rank) fill exactly the same slots.
//
// ---- Step model (what an executor must honour) ----
// Steps run in list order. `input` and `output` name buffers; a compute step also reads the
// routing of the last kGate. Two collectives linked by `overlap_with` form a chunk-pipelined pair
// (SAA: the inter-node all-to-all of chunk i runs alongside the intra-node all-gather of chunk
// i-1); the result equals running them one after the other, which is what the CPU executor does.
// Backward step lists consume the forward's saved buffers; a *Bwd compute step is the
// vector-Jacobian product of the forward step of the same name. Besides its `output`, kIOrderBwd
// writes "d_w" (the gradient of the combine weights, which kGateBwd reads with the load-balancing
// loss's gradient) and kGateBwd writes "d_wg" (the gate weight's); kGateBwd and kOrderBwd add into
// their `output` (both feed the gradient of the tokens).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace uniep::parm {

enum class Schedule { kBaseline, kS1, kS2 };
enum class Pass { kForward, kBackward };
// kLocal: no link (a local slice); kIntra: every peer on this node; kInter: some peer is not.
enum class LinkClass { kLocal, kIntra, kInter };
// kMp is also the ESP group (same ranks). kWorld: all P ranks.
enum class Group { kNone, kMp, kEp, kWorld };
enum class Collective { kNone, kAllGather, kReduceScatter, kAllReduce, kAllToAll };
constexpr int kNumCollectives = 4;  // the four real ones, indexed by collective_index()

enum class Op {
  // compute
  kGate,    // logits, softmax, top-k, slots, load-balancing statistics
  kOrder,   // scatter tokens into the [E, rows, M] dispatch buffer
  kExpert,  // the local shard of every local expert: partial outputs
  kIOrder,  // weighted sum of the expert outputs back to tokens
  kGateBwd,
  kOrderBwd,
  kExpertBwd,
  kIOrderBwd,
  // local slices, no communication: MP-Split
  kMpSplitTokens,    // [S, M] -> this MP rank's slice of tokens
  kMpSplitCapacity,  // [E, N*c, M] -> [E, c, M], this MP rank's capacity block
  // collectives
  kMpAllGatherTokens,    // MP-AllGather, the inverse of kMpSplitTokens
  kMpAllGatherCapacity,  // MP-AllGather, the inverse of kMpSplitCapacity
  kEpAllToAllDispatch,   // [E, r, M] -> [G, E_loc, r, M]: rows for my experts from every node
  kEpAllToAllCombine,    // [G, E_loc, r, M] -> [E, r, M]: the inverse movement
  kEspAllGather,         // [G, E_loc, c, M] -> [N, G, E_loc, c, M]
  kEspReduceScatter,     // [N, G, E_loc, c, M] (partial) -> [G, E_loc, c, M] (summed)
  kEspAllReduce,         // partial -> summed, same shape (the baseline's RowParallel reduce)
  kMpAllReduceStats,     // S1: load-balancing statistics of the slices -> of the MP group
  kWorldAgreeRouting,    // every rank's token count and overflow: all raise or none does
  kMpAllReduceGateGrad,  // S1: the gate weight's gradient from the slices -> of the MP group
};

const char* schedule_name(Schedule s);  // "baseline", "s1", "s2"
const char* pass_name(Pass p);          // "forward", "backward"
const char* op_name(Op op);             // "gate", "ep_all_to_all_dispatch", ...
const char* collective_name(Collective c);
const char* link_class_name(LinkClass l);
const char* group_name(Group g);
// Throw kInvalidArgument naming `schedule` unless text is "baseline", "s1" or "s2".
Schedule parse_schedule(const std::string& text);
int collective_index(Collective c);  // 0..3 for the real ones; throws for kNone

// One MoE layer on one cluster.
struct ParmShape {
  int64_t world_size = 1;     // P
  int64_t mp_size = 1;        // N = MP = ESP group size
  int64_t gpus_per_node = 1;  // which groups cross nodes
  int64_t tokens = 1;         // S: tokens entering the layer per MP group
  int64_t hidden = 1;         // M
  int64_t ffn_hidden = 1;     // H (split N ways)
  int64_t num_experts = 1;    // E (E_loc = E / G per MP group)
  int64_t top_k = 1;
  // <= 0: no token is ever dropped (c = ceil(S/N): a slice cannot send an expert more tokens).
  double capacity_factor = 1.0;
  int64_t dtype_bytes = 2;  // of activations and weights

  // Throws kInvalidArgument naming the first field that is out of range or inconsistent.
  void validate() const;
  int64_t ep_size() const { return world_size / mp_size; }  // G
  int64_t local_experts() const { return num_experts / ep_size(); }
  int64_t expert_shard() const { return ffn_hidden / mp_size; }  // H / N
  int64_t slice_tokens(int64_t m) const;                         // tokens of slice m
  int64_t max_slice_tokens() const { return (tokens + mp_size - 1) / mp_size; }
  // c = max(1, ceil(k * f * S / (E * N))), or ceil(S / N) when capacity_factor <= 0.
  int64_t slice_capacity() const;
  int64_t capacity() const { return mp_size * slice_capacity(); }  // T = N * c
  int64_t dispatch_bytes() const;                                  // D = E * T * M * b
};

// Who is where. Pure function of (P, N, gpus per node).
struct RankLayout {
  int64_t world_size = 1, mp_size = 1, ep_size = 1, gpus_per_node = 1, nodes = 1;
  LinkClass mp_link = LinkClass::kLocal;  // kLocal when N == 1
  LinkClass ep_link = LinkClass::kLocal;  // kLocal when G == 1
  LinkClass world_link = LinkClass::kLocal;
  // Peers of one rank's EP group on its own node / on other nodes (the same for every rank).
  int64_t ep_peers_intra = 0, ep_peers_inter = 0;

  int64_t mp_index(int64_t rank) const { return rank % mp_size; }
  int64_t ep_index(int64_t rank) const { return rank / mp_size; }
  int64_t node_of(int64_t rank) const { return rank / gpus_per_node; }
  std::vector<int64_t> mp_group(int64_t rank) const;  // ascending ranks
  std::vector<int64_t> ep_group(int64_t rank) const;
  int64_t first_expert(int64_t rank, int64_t num_experts) const;  // of its E_loc experts
};
RankLayout rank_layout(int64_t world_size, int64_t mp_size, int64_t gpus_per_node);

struct Step {
  Op op = Op::kGate;
  Collective collective = Collective::kNone;
  Group group = Group::kNone;
  LinkClass link = LinkClass::kLocal;
  // Message size in the cost model's convention: per-rank send buffer (all-to-all), output
  // (all-gather), input (reduce-scatter), buffer (all-reduce). 0 for compute and slices.
  int64_t bytes = 0;
  // Bytes this rank sends over intra-node / inter-node links (ring algorithms; an all-to-all
  // sends each peer its block directly).
  int64_t wire_intra = 0, wire_inter = 0;
  double flops = 0;           // compute steps
  int64_t mem_bytes = 0;      // local memory traffic of a compute step (roofline)
  int stream = 0;             // 0: compute and inter-node traffic; 1: the intra half of an SAA pair
  int64_t overlap_with = -1;  // index of the partner in a chunk-pipelined pair, -1: none
  std::string input, output;
};

struct StepList {
  Schedule schedule = Schedule::kBaseline;
  Pass pass = Pass::kForward;
  ParmShape shape;
  RankLayout layout;
  std::vector<Step> steps;

  int64_t wire_intra() const;  // summed over steps, bytes per rank
  int64_t wire_inter() const;
  std::string describe() const;  // one line per step, for logs and the CLI
};

// The step list of one schedule and pass (validates the shape).
StepList build_steps(const ParmShape& shape, Schedule schedule, Pass pass);

// ---- Cost model ----
// t(n) = alpha + beta * n, seconds and seconds per byte (or per flop).
struct AlphaBeta {
  double alpha = 0;
  double beta = 0;
  double at(double n) const { return alpha + beta * n; }
};
struct AlphaBetaFit {
  AlphaBeta coeffs;
  double r2 = 0;  // coefficient of determination of the fit
  int64_t samples = 0;
};
// Least squares over (n, seconds) samples; needs two distinct sizes.
AlphaBetaFit fit_alpha_beta(const std::vector<double>& sizes, const std::vector<double>& seconds);

// A cluster described by its links and GPUs, from which the ring-model coefficients follow.
struct ClusterSpec {
  int64_t gpus_per_node = 8;
  int64_t nodes = 4;
  double intra_alpha = 5e-6;  // s per message hop
  double intra_bw = 150e9;    // bytes/s per GPU over NVLink/PCIe
  double inter_alpha = 10e-6;
  double inter_bw = 12.5e9;  // bytes/s per GPU over the network (a node's NICs / GPUs)
  double peak_flops = 300e12;
  double mem_bw = 2e12;
  double kernel_alpha = 5e-6;  // launch + tail of one compute step
};

struct CostModel {
  // comm[collective_index][0 = intra, 1 = inter]
  AlphaBeta comm[kNumCollectives][2];
  AlphaBeta gemm;           // beta: seconds per flop
  double mem_beta = 0;      // seconds per byte of local memory traffic
  int64_t max_chunks = 16;  // largest SAA pipeline degree tried (powers of two)
  // Seconds every step costs besides its transfer or compute: the executor's host work and
  // launches per step (fitted by uniep.parm.profile from a small layer; 0 for a described
  // cluster). An SAA pair counts as its two steps.
  double step_alpha = 0;

  // max(gemm.at(flops), kernel alpha + mem_beta * bytes): a roofline with a launch cost.
  double compute_seconds(double flops, double mem_bytes) const;
  double comm_seconds(Collective c, LinkClass link, double bytes) const;
};
// Ring-model coefficients of `spec` for the groups of `layout` (the all-gather over N ranks moves
// (N-1)/N of its output over N-1 hops, and so on).
CostModel cost_model_from_cluster(const ClusterSpec& spec, const RankLayout& layout);

struct Pricing {
  double seconds = 0;
  std::vector<double> step_seconds;  // an SAA pair's time is on its first step, 0 on its second
  std::vector<int64_t> chunks;       // SAA pipeline degree chosen per pair (1 elsewhere)
};
// Throws kInvalidArgument for a step whose overlap_with is neither -1 nor the index of a step
// whose overlap_with names it back.
Pricing price(const StepList& steps, const CostModel& model);
// t = t_a(n_a/r) + (r-1) * max(t_a(n_a/r), t_g(n_g/r)) + t_g(n_g/r), minimised over the powers
// of two r <= max(1, max_chunks) (any int64 max_chunks, INT64_MAX included).
double saa_seconds(const AlphaBeta& a2a, double a2a_bytes, const AlphaBeta& ag, double ag_bytes,
                   int64_t max_chunks, int64_t* best_chunks = nullptr);

struct ScheduleCost {
  Schedule schedule = Schedule::kBaseline;
  double forward = 0, backward = 0;
  double total() const { return forward + backward; }
};
struct Choice {
  Schedule best = Schedule::kBaseline;
  ScheduleCost costs[3];  // baseline, s1, s2
};
// Prices all three schedules (forward + backward) and picks the fastest; ties go to the earlier.
Choice choose(const ParmShape& shape, const CostModel& model);

}  // namespace uniep::parm
