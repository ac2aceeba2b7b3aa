// The step lists of the three schedules, forward and backward. include/uniep/parm.hpp states the
// step model; docs/parm.md derives each list and says which parts are reconstructions.
#include <sstream>

#include "uniep/parm.hpp"
#include "uniep/status.hpp"

namespace uniep::parm {
namespace {

// Sizes every list needs, in elements or bytes of one rank.
struct Dims {
  int64_t b, S, Sm, E, Eloc, G, N, c, T, M, Hn, k;
  int64_t D, Dn;  // dispatch bytes of the MP group (E*T*M*b) and of one capacity block (E*c*M*b)
  explicit Dims(const ParmShape& s)
      : b(s.dtype_bytes),
        S(s.tokens),
        Sm(s.max_slice_tokens()),
        E(s.num_experts),
        Eloc(s.local_experts()),
        G(s.ep_size()),
        N(s.mp_size),
        c(s.slice_capacity()),
        T(s.capacity()),
        M(s.hidden),
        Hn(s.expert_shard()),
        k(s.top_k),
        D(s.dispatch_bytes()),
        Dn(s.dispatch_bytes() / s.mp_size) {}
};

class Builder {
 public:
  Builder(StepList& list) : list_(list), d_(list.shape), l_(list.layout) {}

  void compute(Op op, const char* in, const char* out, double flops, double mem_bytes) {
    Step& s = add(op, in, out);
    s.flops = flops;
    s.mem_bytes = static_cast<int64_t>(mem_bytes);
  }
  void slice(Op op, const char* in, const char* out) { add(op, in, out); }
  // `bytes` in the cost model's convention (see Step::bytes).
  void collective(Op op, Collective kind, Group group, int64_t bytes, const char* in,
                  const char* out) {
    Step& s = add(op, in, out);
    s.collective = kind;
    s.group = group;
    s.bytes = bytes;
    const int64_t n = group == Group::kMp   ? l_.mp_size
                      : group == Group::kEp ? l_.ep_size
                                            : l_.world_size;
    s.link = group == Group::kMp ? l_.mp_link : group == Group::kEp ? l_.ep_link : l_.world_link;
    if (n == 1) return;  // a group of one moves nothing
    int64_t wire = 0;
    switch (kind) {
      case Collective::kAllGather:
      case Collective::kReduceScatter:
        wire = bytes * (n - 1) / n;
        break;
      case Collective::kAllReduce:
        wire = 2 * bytes * (n - 1) / n;
        break;
      case Collective::kAllToAll:
        if (group == Group::kEp) {
          // Each peer gets its own block: count the blocks that leave the node separately.
          s.wire_intra = bytes / n * l_.ep_peers_intra;
          s.wire_inter = bytes / n * l_.ep_peers_inter;
          return;
        }
        wire = bytes * (n - 1) / n;
        break;
      case Collective::kNone:
        break;
    }
    (s.link == LinkClass::kInter ? s.wire_inter : s.wire_intra) = wire;
  }
  // The last two steps (an EP all-to-all then an intra-node all-gather) run chunk-pipelined.
  void pair_last_two() {
    const int64_t n = static_cast<int64_t>(list_.steps.size());
    Step& a = list_.steps[n - 2];
    Step& g = list_.steps[n - 1];
    a.overlap_with = n - 1;
    g.overlap_with = n - 2;
    g.stream = 1;
  }

  // Shared compute steps; s = tokens routed here, rows = rows of the dispatch buffer.
  void gate(const char* in, int64_t s) {
    compute(Op::kGate, in, "route", 2.0 * s * d_.M * d_.E + 8.0 * s * d_.E,
            s * d_.M * d_.b + d_.M * d_.E * 4 + 3 * s * d_.E * 4);
  }
  void order(const char* in, int64_t s, int64_t rows) {
    compute(Op::kOrder, in, "disp", 0, 2 * s * d_.k * d_.M * d_.b + rows * d_.M * d_.b);
  }
  void expert(const char* in, const char* out, bool backward) {
    const double rows = static_cast<double>(d_.E) * d_.T;  // E_loc experts * G nodes * T rows
    const double flops = 4.0 * rows * d_.M * d_.Hn;
    const double mem = (rows * (2.0 * d_.M + 2.0 * d_.Hn) + 2.0 * d_.Eloc * d_.M * d_.Hn) * d_.b;
    if (backward) {
      compute(Op::kExpertBwd, in, out, 2 * flops, 2 * mem);
    } else {
      compute(Op::kExpert, in, out, flops, mem);
    }
  }
  void iorder(const char* in, const char* out, int64_t s, int64_t rows) {
    compute(Op::kIOrder, in, out, 2.0 * s * d_.k * d_.M,
            s * d_.k * d_.M * d_.b + s * d_.M * d_.b + 0 * rows);
  }
  // Every rank's token count and overflow, all-gathered: three int64 per rank.
  void agree() {
    collective(Op::kWorldAgreeRouting, Collective::kAllGather, Group::kWorld, 3 * 8 * l_.world_size,
               "route", "route");
  }

  const Dims& d() const { return d_; }

 private:
  Step& add(Op op, const char* in, const char* out) {
    list_.steps.emplace_back();
    Step& s = list_.steps.back();
    s.op = op;
    s.input = in;
    s.output = out;
    return s;
  }

  StepList& list_;
  Dims d_;
  const RankLayout& l_;
};

// DeepSpeed-MoE with tensor-parallel experts: every MP rank routes and sends all S tokens.
void baseline_forward(Builder& b) {
  const Dims& d = b.d();
  b.gate("x", d.S);
  b.agree();
  b.order("x", d.S, d.E * d.T);
  b.collective(Op::kEpAllToAllDispatch, Collective::kAllToAll, Group::kEp, d.D, "disp", "exp_in");
  b.expert("exp_in", "exp_out", false);
  b.collective(Op::kEspAllReduce, Collective::kAllReduce, Group::kMp, d.D, "exp_out", "exp_out");
  b.collective(Op::kEpAllToAllCombine, Collective::kAllToAll, Group::kEp, d.D, "exp_out", "comb");
  b.iorder("comb", "y", d.S, d.E * d.T);
}

void baseline_backward(Builder& b) {
  const Dims& d = b.d();
  b.compute(Op::kIOrderBwd, "dy", "d_comb", 4.0 * d.S * d.k * d.M, 3.0 * d.S * d.k * d.M * d.b);
  b.collective(Op::kEpAllToAllDispatch, Collective::kAllToAll, Group::kEp, d.D, "d_comb",
               "d_exp_out");
  // The forward all-reduce was a RowParallel reduce: its adjoint is the identity. The input
  // gradient of the column-parallel first GEMM is a partial sum: ColumnParallel's all-reduce.
  b.expert("d_exp_out", "d_exp_in", true);
  b.collective(Op::kEspAllReduce, Collective::kAllReduce, Group::kMp, d.D, "d_exp_in", "d_exp_in");
  b.collective(Op::kEpAllToAllCombine, Collective::kAllToAll, Group::kEp, d.D, "d_exp_in",
               "d_disp");
  b.compute(Op::kOrderBwd, "d_disp", "dx", 0, 2.0 * d.S * d.k * d.M * d.b + d.D);
  b.compute(Op::kGateBwd, "d_w", "dx", 4.0 * d.S * d.M * d.E, 2.0 * d.S * d.M * d.b);
}

// The expert exchange S1 and S2 share, forward and backward: each rank's 1/N slice crosses the
// EP all-to-all while the ESP all-gather of its arrived chunks runs beside it (an SAA pair), the
// expert shards run on the gathered rows, the ESP reduce-scatter gives each rank its slice back,
// and that goes home over the all-to-all. Buffers: the forward's exp_*, the backward's d_exp_*.
void sliced_expert_exchange(Builder& b, const char* from, const char* to, bool backward) {
  const Dims& d = b.d();
  const char* arrived = backward ? "d_exp_out_m" : "exp_in_m";
  const char* gathered = backward ? "d_exp_out" : "exp_in";
  const char* done = backward ? "d_exp_in" : "exp_out";
  const char* scattered = backward ? "d_exp_in_m" : "exp_out_m";
  b.collective(Op::kEpAllToAllDispatch, Collective::kAllToAll, Group::kEp, d.Dn, from, arrived);
  b.collective(Op::kEspAllGather, Collective::kAllGather, Group::kMp, d.D, arrived, gathered);
  b.pair_last_two();
  b.expert(gathered, done, backward);
  b.collective(Op::kEspReduceScatter, Collective::kReduceScatter, Group::kMp, d.D, done, scattered);
  b.collective(Op::kEpAllToAllCombine, Collective::kAllToAll, Group::kEp, d.Dn, scattered, to);
}

// S1: pause MP before the gate. Each MP rank routes its slice; tokens come back with an
// MP-AllGather after the I-order.
void s1_forward(Builder& b) {
  const Dims& d = b.d();
  b.slice(Op::kMpSplitTokens, "x", "x_m");
  b.gate("x_m", d.Sm);
  b.agree();
  // me_e (mean gate probability) of the whole MP group, for the load-balancing loss.
  b.collective(Op::kMpAllReduceStats, Collective::kAllReduce, Group::kMp, 2 * d.E * 4, "route",
               "route");
  b.order("x_m", d.Sm, d.E * d.c);
  sliced_expert_exchange(b, "disp", "comb", false);
  b.iorder("comb", "y_m", d.Sm, d.E * d.c);
  b.collective(Op::kMpAllGatherTokens, Collective::kAllGather, Group::kMp, d.N * d.Sm * d.M * d.b,
               "y_m", "y");
}

void s1_backward(Builder& b) {
  const Dims& d = b.d();
  // The adjoint of an MP-AllGather whose consumer is replicated: each rank keeps its slice.
  b.slice(Op::kMpSplitTokens, "dy", "dy_m");
  b.compute(Op::kIOrderBwd, "dy_m", "d_comb", 4.0 * d.Sm * d.k * d.M, 3.0 * d.Sm * d.k * d.M * d.b);
  sliced_expert_exchange(b, "d_comb", "d_disp", true);
  b.compute(Op::kOrderBwd, "d_disp", "dx_m", 0, 2.0 * d.Sm * d.k * d.M * d.b + d.Dn);
  b.compute(Op::kGateBwd, "d_w", "dx_m", 4.0 * d.Sm * d.M * d.E, 2.0 * d.Sm * d.M * d.b);
  // The slices gated different tokens: the gate weight's gradient is their sum.
  b.collective(Op::kMpAllReduceGateGrad, Collective::kAllReduce, Group::kMp, d.M * d.E * 4, "d_wg",
               "d_wg");
  b.collective(Op::kMpAllGatherTokens, Collective::kAllGather, Group::kMp, d.N * d.Sm * d.M * d.b,
               "dx_m", "dx");
}

// S2: pause MP only around the all-to-alls: route all S tokens (redundantly), then split the
// capacity dimension, and gather it back inside the combine's SAA.
void s2_forward(Builder& b) {
  const Dims& d = b.d();
  b.gate("x", d.S);
  b.agree();
  b.order("x", d.S, d.E * d.T);
  b.slice(Op::kMpSplitCapacity, "disp", "disp_m");
  sliced_expert_exchange(b, "disp_m", "comb_m", false);
  b.collective(Op::kMpAllGatherCapacity, Collective::kAllGather, Group::kMp, d.D, "comb_m", "comb");
  b.pair_last_two();
  b.iorder("comb", "y", d.S, d.E * d.T);
}

void s2_backward(Builder& b) {
  const Dims& d = b.d();
  b.compute(Op::kIOrderBwd, "dy", "d_comb", 4.0 * d.S * d.k * d.M, 3.0 * d.S * d.k * d.M * d.b);
  b.slice(Op::kMpSplitCapacity, "d_comb", "d_comb_m");
  sliced_expert_exchange(b, "d_comb_m", "d_disp_m", true);
  b.collective(Op::kMpAllGatherCapacity, Collective::kAllGather, Group::kMp, d.D, "d_disp_m",
               "d_disp");
  b.pair_last_two();
  b.compute(Op::kOrderBwd, "d_disp", "dx", 0, 2.0 * d.S * d.k * d.M * d.b + d.D);
  b.compute(Op::kGateBwd, "d_w", "dx", 4.0 * d.S * d.M * d.E, 2.0 * d.S * d.M * d.b);
}

}  // namespace

int64_t StepList::wire_intra() const {
  int64_t n = 0;
  for (const Step& s : steps) n += s.wire_intra;
  return n;
}

int64_t StepList::wire_inter() const {
  int64_t n = 0;
  for (const Step& s : steps) n += s.wire_inter;
  return n;
}

std::string StepList::describe() const {
  std::ostringstream os;
  os << schedule_name(schedule) << " " << pass_name(pass) << ": P=" << shape.world_size
     << " N=" << shape.mp_size << " S=" << shape.tokens << " M=" << shape.hidden
     << " H=" << shape.ffn_hidden << " E=" << shape.num_experts << " k=" << shape.top_k
     << " c=" << shape.slice_capacity() << "\n";
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    os << "  " << i << " " << op_name(s.op) << " " << s.input << " -> " << s.output;
    if (s.collective != Collective::kNone) {
      os << "  [" << collective_name(s.collective) << " " << group_name(s.group) << " "
         << link_class_name(s.link) << " " << s.bytes << " B]";
    }
    if (s.flops > 0) os << "  [" << s.flops << " flop]";
    if (s.overlap_with >= 0) os << "  [pipelined with " << s.overlap_with << "]";
    os << "\n";
  }
  return os.str();
}

StepList build_steps(const ParmShape& shape, Schedule schedule, Pass pass) {
  shape.validate();
  StepList list;
  list.schedule = schedule;
  list.pass = pass;
  list.shape = shape;
  list.layout = rank_layout(shape.world_size, shape.mp_size, shape.gpus_per_node);
  Builder b(list);
  const bool fwd = pass == Pass::kForward;
  switch (schedule) {
    case Schedule::kBaseline:
      fwd ? baseline_forward(b) : baseline_backward(b);
      break;
    case Schedule::kS1:
      fwd ? s1_forward(b) : s1_backward(b);
      break;
    case Schedule::kS2:
      fwd ? s2_forward(b) : s2_backward(b);
      break;
  }
  return list;
}

}  // namespace uniep::parm
