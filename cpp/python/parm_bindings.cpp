// uniep._C.parm: the Parm plans (rank layout, step lists) and the cost model, for uniep.parm,
// the simulator and the tests. Enums cross as their names (strings).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "uniep/parm.hpp"
#include "uniep/status.hpp"

namespace py = pybind11;

namespace {

using namespace uniep::parm;

Pass parse_pass(const std::string& text) {
  if (text == "forward") return Pass::kForward;
  if (text == "backward") return Pass::kBackward;
  throw uniep::Error(uniep::StatusCode::kInvalidArgument,
                     "pass must be 'forward' or 'backward', got '" + text + "'");
}

Collective parse_collective(const std::string& text) {
  for (Collective c : {Collective::kAllGather, Collective::kReduceScatter, Collective::kAllReduce,
                       Collective::kAllToAll}) {
    if (text == collective_name(c)) return c;
  }
  throw uniep::Error(uniep::StatusCode::kInvalidArgument,
                     "collective must be all_gather, reduce_scatter, all_reduce or all_to_all, "
                     "got '" +
                         text + "'");
}

int parse_link(const std::string& text) {
  if (text == "intra") return 0;
  if (text == "inter") return 1;
  throw uniep::Error(uniep::StatusCode::kInvalidArgument,
                     "link must be 'intra' or 'inter', got '" + text + "'");
}

}  // namespace

void bind_parm(py::module& parent) {
  py::module m = parent.def_submodule("parm", "Parm plans and cost model (include/uniep/parm.hpp)");

  py::class_<ParmShape>(m, "ParmShape", "One MoE layer on one cluster (see parm.hpp).")
      .def(py::init([](int64_t world_size, int64_t mp_size, int64_t gpus_per_node, int64_t tokens,
                       int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t top_k,
                       double capacity_factor, int64_t dtype_bytes) {
             ParmShape s;
             s.world_size = world_size;
             s.mp_size = mp_size;
             s.gpus_per_node = gpus_per_node;
             s.tokens = tokens;
             s.hidden = hidden;
             s.ffn_hidden = ffn_hidden;
             s.num_experts = num_experts;
             s.top_k = top_k;
             s.capacity_factor = capacity_factor;
             s.dtype_bytes = dtype_bytes;
             s.validate();
             return s;
           }),
           py::kw_only(), py::arg("world_size"), py::arg("mp_size"), py::arg("gpus_per_node"),
           py::arg("tokens"), py::arg("hidden"), py::arg("ffn_hidden"), py::arg("num_experts"),
           py::arg("top_k"), py::arg("capacity_factor") = 1.0, py::arg("dtype_bytes") = 2)
      .def_readonly("world_size", &ParmShape::world_size)
      .def_readonly("mp_size", &ParmShape::mp_size)
      .def_readonly("gpus_per_node", &ParmShape::gpus_per_node)
      .def_readonly("tokens", &ParmShape::tokens)
      .def_readonly("hidden", &ParmShape::hidden)
      .def_readonly("ffn_hidden", &ParmShape::ffn_hidden)
      .def_readonly("num_experts", &ParmShape::num_experts)
      .def_readonly("top_k", &ParmShape::top_k)
      .def_readonly("capacity_factor", &ParmShape::capacity_factor)
      .def_readonly("dtype_bytes", &ParmShape::dtype_bytes)
      .def_property_readonly("ep_size", &ParmShape::ep_size)
      .def_property_readonly("local_experts", &ParmShape::local_experts)
      .def_property_readonly("expert_shard", &ParmShape::expert_shard)
      .def_property_readonly("slice_capacity", &ParmShape::slice_capacity)
      .def_property_readonly("capacity", &ParmShape::capacity)
      .def_property_readonly("max_slice_tokens", &ParmShape::max_slice_tokens)
      .def_property_readonly("dispatch_bytes", &ParmShape::dispatch_bytes)
      .def("slice_tokens", &ParmShape::slice_tokens, py::arg("m"));

  py::class_<RankLayout>(m, "RankLayout", "Who is where: groups and the links they cross.")
      .def_readonly("world_size", &RankLayout::world_size)
      .def_readonly("mp_size", &RankLayout::mp_size)
      .def_readonly("ep_size", &RankLayout::ep_size)
      .def_readonly("gpus_per_node", &RankLayout::gpus_per_node)
      .def_readonly("nodes", &RankLayout::nodes)
      .def_property_readonly("mp_link",
                             [](const RankLayout& l) { return link_class_name(l.mp_link); })
      .def_property_readonly("ep_link",
                             [](const RankLayout& l) { return link_class_name(l.ep_link); })
      .def_readonly("ep_peers_intra", &RankLayout::ep_peers_intra)
      .def_readonly("ep_peers_inter", &RankLayout::ep_peers_inter)
      .def("mp_index", &RankLayout::mp_index, py::arg("rank"))
      .def("ep_index", &RankLayout::ep_index, py::arg("rank"))
      .def("mp_group", &RankLayout::mp_group, py::arg("rank"))
      .def("ep_group", &RankLayout::ep_group, py::arg("rank"))
      .def("first_expert", &RankLayout::first_expert, py::arg("rank"), py::arg("num_experts"));
  m.def("rank_layout", &rank_layout, py::arg("world_size"), py::arg("mp_size"),
        py::arg("gpus_per_node"));

  py::class_<Step>(m, "Step", "One step of a schedule (see the step model in parm.hpp).")
      .def_property_readonly("op", [](const Step& s) { return op_name(s.op); })
      .def_property_readonly("collective",
                             [](const Step& s) { return collective_name(s.collective); })
      .def_property_readonly("group", [](const Step& s) { return group_name(s.group); })
      .def_property_readonly("link", [](const Step& s) { return link_class_name(s.link); })
      .def_readonly("bytes", &Step::bytes)
      .def_readonly("wire_intra", &Step::wire_intra)
      .def_readonly("wire_inter", &Step::wire_inter)
      .def_readonly("flops", &Step::flops)
      .def_readonly("mem_bytes", &Step::mem_bytes)
      .def_readonly("stream", &Step::stream)
      .def_readonly("overlap_with", &Step::overlap_with)
      .def_readonly("input", &Step::input)
      .def_readonly("output", &Step::output)
      .def("__repr__", [](const Step& s) {
        return std::string("Step(") + op_name(s.op) + ", " + s.input + " -> " + s.output + ")";
      });

  py::class_<StepList>(m, "StepList", "The steps of one schedule and pass.")
      .def_property_readonly("schedule",
                             [](const StepList& l) { return schedule_name(l.schedule); })
      .def_property_readonly("pass_", [](const StepList& l) { return pass_name(l.pass); })
      .def_readonly("shape", &StepList::shape)
      .def_readonly("layout", &StepList::layout)
      .def_readonly("steps", &StepList::steps)
      .def_property_readonly("wire_intra", &StepList::wire_intra)
      .def_property_readonly("wire_inter", &StepList::wire_inter)
      .def("describe", &StepList::describe);
  m.def(
      "build_steps",
      [](const ParmShape& shape, const std::string& schedule, const std::string& pass) {
        return build_steps(shape, parse_schedule(schedule), parse_pass(pass));
      },
      py::arg("shape"), py::arg("schedule"), py::arg("pass_"));

  py::class_<AlphaBeta>(m, "AlphaBeta", "t(n) = alpha + beta * n (seconds, seconds per unit).")
      .def(py::init([](double a, double b) { return AlphaBeta{a, b}; }), py::arg("alpha") = 0.0,
           py::arg("beta") = 0.0)
      .def_readwrite("alpha", &AlphaBeta::alpha)
      .def_readwrite("beta", &AlphaBeta::beta)
      .def("at", &AlphaBeta::at, py::arg("n"));
  py::class_<AlphaBetaFit>(m, "AlphaBetaFit")
      .def_readonly("coeffs", &AlphaBetaFit::coeffs)
      .def_property_readonly("alpha", [](const AlphaBetaFit& f) { return f.coeffs.alpha; })
      .def_property_readonly("beta", [](const AlphaBetaFit& f) { return f.coeffs.beta; })
      .def_readonly("r2", &AlphaBetaFit::r2)
      .def_readonly("samples", &AlphaBetaFit::samples);
  m.def("fit_alpha_beta", &fit_alpha_beta, py::arg("sizes"), py::arg("seconds"));

  py::class_<ClusterSpec>(m, "ClusterSpec", "Links and GPUs of a cluster (per-GPU bandwidths).")
      .def(py::init<>())
      .def_readwrite("gpus_per_node", &ClusterSpec::gpus_per_node)
      .def_readwrite("nodes", &ClusterSpec::nodes)
      .def_readwrite("intra_alpha", &ClusterSpec::intra_alpha)
      .def_readwrite("intra_bw", &ClusterSpec::intra_bw)
      .def_readwrite("inter_alpha", &ClusterSpec::inter_alpha)
      .def_readwrite("inter_bw", &ClusterSpec::inter_bw)
      .def_readwrite("peak_flops", &ClusterSpec::peak_flops)
      .def_readwrite("mem_bw", &ClusterSpec::mem_bw)
      .def_readwrite("kernel_alpha", &ClusterSpec::kernel_alpha);

  py::class_<CostModel>(m, "CostModel", "alpha-beta per (collective, link class) + a roofline.")
      .def(py::init<>())
      .def(
          "get",
          [](const CostModel& cm, const std::string& c, const std::string& link) {
            return cm.comm[collective_index(parse_collective(c))][parse_link(link)];
          },
          py::arg("collective"), py::arg("link"))
      .def(
          "set",
          [](CostModel& cm, const std::string& c, const std::string& link, const AlphaBeta& ab) {
            cm.comm[collective_index(parse_collective(c))][parse_link(link)] = ab;
          },
          py::arg("collective"), py::arg("link"), py::arg("coeffs"))
      .def_readwrite("gemm", &CostModel::gemm)
      .def_readwrite("mem_beta", &CostModel::mem_beta)
      .def_readwrite("max_chunks", &CostModel::max_chunks)
      .def_readwrite("step_alpha", &CostModel::step_alpha)
      .def("compute_seconds", &CostModel::compute_seconds, py::arg("flops"), py::arg("mem_bytes"))
      // Picklable so that a fitted model reaches spawned ranks (uniep.parm.profile).
      .def(py::pickle(
          [](const CostModel& cm) {
            py::list comm;
            for (const auto& links : cm.comm)
              for (const AlphaBeta& ab : links) comm.append(py::make_tuple(ab.alpha, ab.beta));
            return py::make_tuple(comm, py::make_tuple(cm.gemm.alpha, cm.gemm.beta), cm.mem_beta,
                                  cm.max_chunks, cm.step_alpha);
          },
          [](const py::tuple& t) {
            if (t.size() != 5) throw std::invalid_argument("CostModel: not a pickled CostModel");
            const auto comm = t[0].cast<std::vector<std::pair<double, double>>>();
            if (comm.size() != kNumCollectives * 2)
              throw std::invalid_argument("CostModel: not a pickled CostModel");
            CostModel cm;
            for (size_t i = 0; i < comm.size(); ++i)
              cm.comm[i / 2][i % 2] = AlphaBeta{comm[i].first, comm[i].second};
            const auto gemm = t[1].cast<std::pair<double, double>>();
            cm.gemm = AlphaBeta{gemm.first, gemm.second};
            cm.mem_beta = t[2].cast<double>();
            cm.max_chunks = t[3].cast<int64_t>();
            cm.step_alpha = t[4].cast<double>();
            return cm;
          }));
  m.def("cost_model_from_cluster", &cost_model_from_cluster, py::arg("spec"), py::arg("layout"));

  py::class_<Pricing>(m, "Pricing")
      .def_readonly("seconds", &Pricing::seconds)
      .def_readonly("step_seconds", &Pricing::step_seconds)
      .def_readonly("chunks", &Pricing::chunks);
  m.def("price", &price, py::arg("steps"), py::arg("model"));
  m.def(
      "saa_seconds",
      [](const AlphaBeta& a2a, double a2a_bytes, const AlphaBeta& ag, double ag_bytes,
         int64_t max_chunks) {
        int64_t r = 1;
        const double t = saa_seconds(a2a, a2a_bytes, ag, ag_bytes, max_chunks, &r);
        return py::make_tuple(t, r);
      },
      py::arg("a2a"), py::arg("a2a_bytes"), py::arg("ag"), py::arg("ag_bytes"),
      py::arg("max_chunks") = 16, "(seconds, chunks) of the pipelined all-to-all + all-gather.");
  m.def(
      "choose",
      [](const ParmShape& shape, const CostModel& model) {
        const Choice c = choose(shape, model);
        py::dict costs;
        for (const ScheduleCost& sc : c.costs) {
          costs[schedule_name(sc.schedule)] = py::make_tuple(sc.forward, sc.backward);
        }
        return py::make_tuple(std::string(schedule_name(c.best)), costs);
      },
      py::arg("shape"), py::arg("model"),
      "(best schedule name, {name: (forward seconds, backward seconds)}).");
}
