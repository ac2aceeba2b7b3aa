// uniep._C: the planner, the tuning space and build facts for Python. Loading this module also
// registers the torch.ops.uniep operators (cpp/torch).
#include <cstring>
#include <memory>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/cpu_wire.hpp"
#include "python/build_info.hpp"
#include "torch/collectives/peer_transport.hpp"
#include "torch/common/call_checks.hpp"
#ifdef UNIEP_WITH_CUDA_OPS
#include "torch/collectives/gemm.hpp"
#include "torch/collectives/registry.hpp"
#include "torch/common/runtime_registry.hpp"
#include "torch/ep/registry.hpp"
#include "torch/gemm/fp8_experts.hpp"
#include "torch/megakernel/registry.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#endif
#include "uniep/node_plan.hpp"
#include "uniep/plan.hpp"
#include "uniep/send_rows_error.hpp"
#include "uniep/status.hpp"
#include "uniep/tuning.hpp"

namespace py = pybind11;

// cpp/python/collectives_bindings.cpp
void bind_collectives(py::module& m);
// cpp/python/parm_bindings.cpp
void bind_parm(py::module& m);

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

namespace {

using namespace uniep;

const int64_t* topk_rows(const I64Array& a, const char* name, int64_t& tokens, int64_t& top_k) {
  UNIEP_CHECK(a.ndim() == 2, name, " must be a 2-D int64 array [T, K], got ", a.ndim(), " dims");
  tokens = a.shape(0);
  top_k = a.shape(1);
  UNIEP_CHECK(top_k >= 1, name, " must have at least one column");
  return a.data();
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

py::tuple compute_layout_py(const I64Array& topk_idx, int64_t num_experts, int64_t world_size) {
  MoeShape shape;
  const int64_t* p = topk_rows(topk_idx, "topk_idx", shape.tokens, shape.top_k);
  shape.hidden = shape.ffn_hidden = 1;
  shape.num_experts = num_experts;
  shape.world_size = world_size;
  const RoutingLayout l = compute_layout(p, shape);
  py::array_t<uint8_t> in_rank(to_array(l.token_in_rank));
  return py::make_tuple(to_array(l.tokens_per_rank), to_array(l.tokens_per_expert),
                        in_rank.reshape({shape.tokens, world_size}));
}

// Every rank's shape and layout of a simulated group: one routing per rank, in rank order.
struct SimulatedRanks {
  std::vector<MoeShape> shapes;
  std::vector<RoutingLayout> layouts;
};
SimulatedRanks simulate_ranks(const std::vector<I64Array>& all_topk, int64_t num_experts,
                              int64_t rank, int64_t ranks_per_node) {
  const int64_t W = all_topk.size();
  UNIEP_CHECK(W >= 1, "all_topk must hold one routing per rank");
  UNIEP_CHECK(rank >= 0 && rank < W, "rank must be in [0, ", W, "), got ", rank);
  SimulatedRanks sim{std::vector<MoeShape>(W), std::vector<RoutingLayout>(W)};
  for (int64_t r = 0; r < W; ++r) {
    MoeShape& s = sim.shapes[r];
    topk_rows(all_topk[r], "all_topk[r]", s.tokens, s.top_k);
    UNIEP_CHECK(s.top_k == sim.shapes[0].top_k, "all_topk: every rank must have the same K");
    s.hidden = s.ffn_hidden = 1;
    s.num_experts = num_experts;
    s.world_size = W;
    s.rank = r;
    s.ranks_per_node = ranks_per_node;
    sim.layouts[r] = compute_layout(all_topk[r].data(), s);
  }
  return sim;
}

// The two-level plan of one rank, with the count exchange and the rail leg simulated in-process
// from every rank's routing: what the relay forwards where, and the slot each relayed row
// lands in on `rank` (to compare with the flat plan's send_slots).
py::dict build_node_plan_py(const std::vector<I64Array>& all_topk, int64_t num_experts,
                            int64_t ranks_per_node, int64_t rank) {
  const int64_t W = all_topk.size();
  auto [shapes, layouts] = simulate_ranks(all_topk, num_experts, rank, ranks_per_node);
  const int64_t N = shapes[0].num_nodes(), K = shapes[0].top_k;
  std::vector<int64_t> rank_counts(W * W), node_counts(W * N);
  for (int64_t r = 0; r < W; ++r) {
    std::copy(layouts[r].tokens_per_rank.begin(), layouts[r].tokens_per_rank.end(),
              rank_counts.begin() + r * W);
    const std::vector<int64_t> per_node = tokens_per_node(layouts[r], shapes[r]);
    std::copy(per_node.begin(), per_node.end(), node_counts.begin() + r * N);
  }
  std::vector<NodePlan> plans(W);
  for (int64_t r = 0; r < W; ++r) plans[r] = plan_nodes(layouts[r], node_counts.data(), shapes[r]);
  const MoeShape& me = shapes[rank];
  const NodePlan& mine = plans[rank];
  // The rail leg: group m holds the tokens of (m, local) bound for this node, in its order.
  const int64_t home = me.node_of(rank);
  std::vector<int64_t> relayed_src(mine.num_relayed()), relayed_token(mine.num_relayed());
  std::vector<int64_t> relayed_topk(mine.num_relayed() * K);
  for (int64_t m = 0; m < N; ++m) {
    const int64_t source = mine.relay_source(m, rank);
    const NodePlan& sp = plans[source];
    const int64_t n = sp.send_offsets[home + 1] - sp.send_offsets[home];
    UNIEP_CHECK_CODE(n == mine.relay_offsets[m + 1] - mine.relay_offsets[m], StatusCode::kInternal,
                     "relay sizes disagree");
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = mine.relay_offsets[m] + j, t = sp.send_tokens[sp.send_offsets[home] + j];
      relayed_src[i] = source;
      relayed_token[i] = t;
      std::copy(all_topk[source].data() + t * K, all_topk[source].data() + (t + 1) * K,
                relayed_topk.begin() + i * K);
    }
  }
  const RelayPlan relay = plan_relay(mine, relayed_topk.data(), rank_counts.data(), me);
  py::dict d;
  d["node_send_offsets"] = to_array(mine.send_offsets);
  d["node_send_tokens"] = to_array(mine.send_tokens);
  d["relay_offsets"] = to_array(mine.relay_offsets);
  d["relayed_src_rank"] = to_array(relayed_src);
  d["relayed_token"] = to_array(relayed_token);
  d["forward_offsets"] = to_array(relay.offsets);
  d["forward_rows"] = to_array(relay.rows);
  d["arrival_slots"] = to_array(relayed_slot_order(rank_counts.data(), me));
  return d;
}

// Runs the planner for one rank with the count exchange and the metadata dispatch simulated
// in-process from every rank's routing: the pure functions, end to end, without a transport.
py::dict build_rank_plan_py(const std::vector<I64Array>& all_topk, int64_t num_experts,
                            int64_t rank, const std::string& tuning, int64_t gate_tile_m) {
  const int64_t W = all_topk.size();
  const TuningParams params = TuningParams::parse(tuning);
  auto [shapes, layouts] = simulate_ranks(all_topk, num_experts, rank, 0);
  std::vector<int64_t> rank_counts(W * W), expert_counts(W * num_experts);
  for (int64_t r = 0; r < W; ++r) {
    std::copy(layouts[r].tokens_per_rank.begin(), layouts[r].tokens_per_rank.end(),
              rank_counts.begin() + r * W);
    std::copy(layouts[r].tokens_per_expert.begin(), layouts[r].tokens_per_expert.end(),
              expert_counts.begin() + r * num_experts);
  }
  const MoeShape& me = shapes[rank];
  const int64_t K = me.top_k;
  std::vector<SlotPlan> plans(W);
  for (int64_t r = 0; r < W; ++r) plans[r] = plan_slots(layouts[r], rank_counts.data(), shapes[r]);
  const SlotPlan& mine = plans[rank];
  // What the dispatch would deliver here: every source's tokens at the slots it computed.
  std::vector<int64_t> src_token(mine.num_recv(), -1), recv_topk(mine.num_recv() * K, -1);
  for (int64_t s = 0; s < W; ++s) {
    const SlotPlan& p = plans[s];
    for (int64_t i = p.send_offsets[rank]; i < p.send_offsets[rank + 1]; ++i) {
      const int64_t t = p.send_tokens[i], slot = p.send_slots[i];
      src_token[slot] = t;
      std::copy(all_topk[s].data() + t * K, all_topk[s].data() + (t + 1) * K,
                recv_topk.begin() + slot * K);
    }
  }
  const ExpertPlan ep =
      plan_experts(mine, src_token.data(), recv_topk.data(), expert_counts.data(), me);
  const std::vector<int64_t> src_off = expert_source_offsets(expert_counts.data(), me);
  const std::vector<WorkTile> tiles = schedule_expert_tiles(ep, src_off, params, me);
  py::array_t<int64_t> tile_arr({static_cast<py::ssize_t>(tiles.size()), py::ssize_t(4)});
  auto t = tile_arr.mutable_unchecked<2>();
  for (size_t i = 0; i < tiles.size(); ++i) {
    t(i, 0) = tiles[i].expert;
    t(i, 1) = tiles[i].row_begin;
    t(i, 2) = tiles[i].row_end;
    t(i, 3) = tiles[i].src_rank;
  }
  py::dict d;
  d["send_offsets"] = to_array(mine.send_offsets);
  d["send_tokens"] = to_array(mine.send_tokens);
  d["send_slots"] = to_array(mine.send_slots);
  d["recv_offsets"] = to_array(mine.recv_offsets);
  d["recv_src_token"] = to_array(src_token);
  d["row_offsets"] = to_array(ep.row_offsets);
  d["row_slot"] = to_array(ep.row_slot);
  d["row_src_rank"] = to_array(ep.row_src_rank);
  d["row_combine_slot"] = to_array(ep.row_combine_slot);
  d["return_counts"] = to_array(ep.return_counts);
  d["expert_source_offsets"] = to_array(src_off).reshape({me.experts_per_rank(), W + 1});
  d["tiles"] = tile_arr;
  const SenderRows sr =
      plan_sender_rows(all_topk[rank].data(), expert_counts.data(), me, gate_tile_m);
  if (const Status s = send_rows_error_status(sr.error, K, "plan_sender_rows"); !s.ok())
    throw Error(s.code, s.message);
  d["send_gemm_rank"] = to_array(sr.dest_rank).reshape({me.tokens, K});
  d["send_gemm_row"] = to_array(sr.gemm_row).reshape({me.tokens, K});
  d["send_gate_counter"] = to_array(sr.counter).reshape({me.tokens, K});
  return d;
}

// The CPU executor's fp8 wire encoding of float rows, for checking the GPU cast bit for bit.
py::tuple encode_fp8_rows_py(
    const py::array_t<float, py::array::c_style | py::array::forcecast>& x) {
  UNIEP_CHECK(x.ndim() == 2, "x must be a 2-D float32 array [N, H], got ", x.ndim(), " dims");
  const int64_t N = x.shape(0), H = x.shape(1), blocks = cpu::fp8_blocks(H);
  const int64_t row = cpu::wire_row_bytes<float>(H, DispatchPrecision::kFp8E4M3);
  std::vector<uint8_t> wire(row);
  py::array_t<uint8_t> q({N, H});
  py::array_t<float> scales({N, blocks});
  for (int64_t i = 0; i < N; ++i) {
    cpu::encode_row(x.data() + i * H, H, DispatchPrecision::kFp8E4M3, wire.data());
    std::memcpy(q.mutable_data() + i * H, wire.data(), H);
    std::memcpy(scales.mutable_data() + i * blocks, wire.data() + H, blocks * sizeof(float));
  }
  return py::make_tuple(q, scales);
}

#ifdef UNIEP_WITH_CUDA_OPS
uniep::fused::Config fused_config(int64_t world_size, int64_t rank, int64_t max_tokens,
                                  int64_t hidden, int64_t ffn, int64_t top_k, int64_t num_experts,
                                  double timeout_s, int64_t tile_m, bool backward) {
  uniep::fused::Config c;
  c.tile_m = static_cast<int>(tile_m);
  c.backward = backward;
  c.world_size = world_size;
  c.rank = rank;
  c.max_tokens = max_tokens;
  c.hidden = hidden;
  c.ffn = ffn;
  c.top_k = top_k;
  c.num_experts = num_experts;
  c.timeout_s = timeout_s;
  return c;
}

uniep::ep::Config ep_config(int64_t max_tokens, int64_t hidden, int64_t top_k, int64_t num_experts,
                            int64_t world_size, int64_t max_row_bytes, int64_t ll_max_tokens) {
  uniep::ep::Config c;
  c.max_tokens = max_tokens;
  c.hidden = hidden;
  c.top_k = top_k;
  c.num_experts = num_experts;
  c.world_size = world_size;
  c.max_row_bytes = max_row_bytes;
  c.ll_max_tokens = ll_max_tokens;
  return c;
}
#endif

// The call agreement (torch/common/call_checks.hpp) for calls checked in Python: the signature
// fields, this rank's error (empty if its checks passed). Raises on every rank as the C++ ops do.
void agree_call_py(const std::string& group_name, const std::string& kind_name,
                   const std::vector<std::pair<std::string, int64_t>>& fields,
                   const std::string& error, const std::string& device) {
  CallKind kind;
  if (kind_name == "moe_forward")
    kind = CallKind::kMoeForward;
  else if (kind_name == "moe_backward")
    kind = CallKind::kMoeBackward;
  else if (kind_name == "ep_runtime_create")
    kind = CallKind::kEpRuntimeCreate;
  else
    UNIEP_CHECK(false, "kind must be moe_forward, moe_backward or ep_runtime_create, got '",
                kind_name, "'");
  UNIEP_CHECK(static_cast<int64_t>(fields.size()) <= kMaxCallFields, "fields: at most ",
              kMaxCallFields, ", got ", fields.size());
  const torch_glue::Group group = torch_glue::resolve_group(group_name);
  // The exchange waits on the peers without the GIL: holding it there deadlocked the ranks
  // when the call came right after a backward through the ops (seen on gloo, four CPU ranks).
  py::gil_scoped_release no_gil;
  torch_glue::check_and_agree(group, kind, c10::Device(device), [&] {
    UNIEP_CHECK(error.empty(), error);
    CallSignature signature{kind, {}};
    for (const auto& [name, value] : fields) signature.fields.push_back({name.c_str(), value});
    return signature;
  });
}

// Every rank's `values` for a call whose ranks compare them themselves (see share_call); `kind`:
// "expert_shard_check".
std::vector<int64_t> share_call_py(const std::string& group_name, const std::string& kind_name,
                                   const std::vector<int64_t>& values, const std::string& device) {
  UNIEP_CHECK(kind_name == "expert_shard_check", "kind must be expert_shard_check, got '",
              kind_name, "'");
  UNIEP_CHECK(static_cast<int64_t>(values.size()) <= kMaxCallFields, "values: at most ",
              kMaxCallFields, ", got ", values.size());
  CallSignature signature{CallKind::kExpertShardCheck, {}};
  for (int64_t v : values) signature.fields.push_back({"value", v});
  const torch_glue::Group group = torch_glue::resolve_group(group_name);
  py::gil_scoped_release no_gil;  // as agree_call: the exchange waits on the peers
  return torch_glue::share_on_group(group, c10::Device(device), signature);
}

// A collective's argument check made in Python (uniep.nn's tensor-parallel layers) failed: this
// rank joins the peers' agreement in that op as failed, so they raise at once ("rank r passed
// invalid arguments") instead of waiting for it, and raises `error` here.
void coll_fail_call_py(const std::string& group_name, const std::string& kind_name,
                       const std::string& error) {
  const CollectiveKind kind = parse_collective_kind(kind_name);
  const torch_glue::Group group = torch_glue::resolve_group(group_name);
  std::unique_ptr<PeerTransport> transport = torch_glue::make_peer_transport(group);
  py::gil_scoped_release no_gil;  // as agree_call: the exchange waits on the peers
  fail_collective_call(kind, Error(StatusCode::kInvalidArgument, error), *transport);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "UniEP native module: planner, tuning space, build facts; registers torch.ops.uniep";

  static py::exception<uniep::Error> unused(m, "UniepError", PyExc_RuntimeError);
  (void)unused;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const uniep::Error& e) {
      if (e.code() == uniep::StatusCode::kInvalidArgument) {
        PyErr_SetString(PyExc_ValueError, e.what());
      } else if (e.code() == uniep::StatusCode::kTimeout) {
        PyErr_SetString(PyExc_TimeoutError, e.what());
      } else {
        PyErr_SetString(PyExc_RuntimeError, e.what());
      }
    }
  });

  // Every setter marks its key given, as parse does for the keys it reads.
  auto int_key = [](int TuningParams::* field, TuningKey key) {
    return py::cpp_function([field, key](TuningParams& p, int v) {
      p.*field = v;
      p.set_given(key);
    });
  };
  auto int_get = [](int TuningParams::* field) {
    return py::cpp_function([field](const TuningParams& p) { return p.*field; });
  };
  py::class_<TuningParams>(m, "TuningParams")
      .def(py::init<>())
      .def_static("parse", &TuningParams::parse, py::arg("text"),
                  "Parse 'sms=24/132,token_tile=64,...'; missing keys keep their defaults.")
      .def("to_string", &TuningParams::to_string, py::arg("given_only") = false,
           "Every key, or (given_only) the given ones alone ('' when none is).")
      .def("validate", &TuningParams::validate)
      .def(
          "given",
          [](const TuningParams& p, const std::string& key) { return p.given(tuning_key(key)); },
          py::arg("key"),
          "Whether `key` was given (parsed, or set), rather than left at its default.")
      .def_property_readonly("given_keys",
                             [](const TuningParams& p) {
                               std::vector<std::string> keys;
                               for (int k = 0; k < static_cast<int>(TuningKey::kCount); ++k)
                                 if (p.given(static_cast<TuningKey>(k)))
                                   keys.emplace_back(tuning_key_name(static_cast<TuningKey>(k)));
                               return keys;
                             })
      .def_property("comm_sms", int_get(&TuningParams::comm_sms),
                    int_key(&TuningParams::comm_sms, TuningKey::kSms))
      .def_property("total_sms", int_get(&TuningParams::total_sms),
                    int_key(&TuningParams::total_sms, TuningKey::kSms))
      .def_property("token_tile", int_get(&TuningParams::token_tile),
                    int_key(&TuningParams::token_tile, TuningKey::kTokenTile))
      .def_property("tile_m", int_get(&TuningParams::tile_m),
                    int_key(&TuningParams::tile_m, TuningKey::kTileM))
      .def_property("tile_n", int_get(&TuningParams::tile_n),
                    int_key(&TuningParams::tile_n, TuningKey::kTileN))
      .def_property("tile_k", int_get(&TuningParams::tile_k),
                    int_key(&TuningParams::tile_k, TuningKey::kTileK))
      .def_property("stages", int_get(&TuningParams::stages),
                    int_key(&TuningParams::stages, TuningKey::kStages))
      .def_property("cluster", int_get(&TuningParams::cluster),
                    int_key(&TuningParams::cluster, TuningKey::kCluster))
      .def_property("skip_rounds", int_get(&TuningParams::skip_rounds),
                    int_key(&TuningParams::skip_rounds, TuningKey::kSkipRounds))
      .def_property(
          "overlap",
          [](const TuningParams& p) { return std::string(overlap_mode_name(p.overlap)); },
          [](TuningParams& p, const std::string& v) {
            p.overlap = parse_overlap_mode(v);
            p.set_given(TuningKey::kOverlap);
          })
      .def_property(
          "dispatch",
          [](const TuningParams& p) { return std::string(dispatch_precision_name(p.dispatch)); },
          [](TuningParams& p, const std::string& v) {
            p.dispatch = parse_dispatch_precision(v);
            p.set_given(TuningKey::kDispatch);
          })
      .def_property(
          "combine",
          [](const TuningParams& p) { return std::string(combine_reduction_name(p.combine)); },
          [](TuningParams& p, const std::string& v) {
            p.combine = parse_combine_reduction(v);
            p.set_given(TuningKey::kCombine);
          })
      .def_property(
          "gemm", [](const TuningParams& p) { return std::string(gemm_engine_name(p.gemm)); },
          [](TuningParams& p, const std::string& v) {
            p.gemm = parse_gemm_engine(v);
            p.set_given(TuningKey::kGemm);
          })
      .def_property(
          "experts",
          [](const TuningParams& p) { return std::string(expert_precision_name(p.experts)); },
          [](TuningParams& p, const std::string& v) {
            // The pair experts=fp8 with dispatch=bf16 is refused by validate(), not here, so
            // that the two may be set in either order.
            p.experts = parse_expert_precision(v);
            p.set_given(TuningKey::kExperts);
          })
      .def_property_readonly("fp8_experts", &TuningParams::fp8_experts)
      .def("__eq__", [](const TuningParams& a, const TuningParams& b) { return a == b; })
      .def("__hash__",
           [](const TuningParams& p) { return std::hash<std::string>()(p.to_string()); })
      .def("__str__", [](const TuningParams& p) { return p.to_string(); })
      .def("__repr__",
           [](const TuningParams& p) { return "TuningParams('" + p.to_string() + "')"; });

  py::class_<MoeShape>(m, "MoeShape")
      .def(py::init<>())
      .def_readwrite("tokens", &MoeShape::tokens)
      .def_readwrite("hidden", &MoeShape::hidden)
      .def_readwrite("ffn_hidden", &MoeShape::ffn_hidden)
      .def_readwrite("num_experts", &MoeShape::num_experts)
      .def_readwrite("top_k", &MoeShape::top_k)
      .def_readwrite("world_size", &MoeShape::world_size)
      .def_readwrite("rank", &MoeShape::rank)
      .def_readwrite("ranks_per_node", &MoeShape::ranks_per_node)
      .def("validate", &MoeShape::validate)
      .def("__repr__", &MoeShape::to_string);
  m.def("grouped_gemm_auto_config", &uniep::grouped_gemm_auto_config, py::arg("rows"),
        py::arg("num_experts"), py::arg("n"), py::arg("k"), py::arg("swiglu"),
        py::arg("pingpong_rows"),
        "The expert GEMM engine's automatic configuration for a grouped problem's shape: the "
        "index into its compiled configurations (uniep.tuning.tuner.CUDA_TILES), as "
        "grouped_gemm_select "
        "picks it on CUDA.");
  m.def("grouped_gemm_auto_cluster", &uniep::grouped_gemm_auto_cluster, py::arg("rows"),
        py::arg("num_experts"),
        "The thread-block cluster (CTAs along M) the expert GEMM engine gives R rows over E "
        "experts with the cluster left to it, for a tile compiled in more than one: 1 where the "
        "experts average at most 256 rows, else 2.");
  m.def("fused_auto_tile_n", &uniep::fused_auto_tile_n, py::arg("tile_m"), py::arg("capacity"),
        py::arg("num_experts"), py::arg("ffn") = 0, py::arg("sm_count") = 0,
        "The MegaKernel's tile width with tile_n left to the launch (uniep/tuning.hpp "
        "fused_auto_tile_n): 128 for 64-row tiles on decode batches, unless GEMM 1's tiles then "
        "take two rounds of the SMs where 256 takes one; else 256.");
  m.def("grouped_gemm_fp8_auto_config", &uniep::grouped_gemm_fp8_auto_config, py::arg("rows"),
        py::arg("num_experts"),
        "The fp8 grouped GEMM's automatic configuration for R rows over E experts: the index "
        "into its compiled configurations (uniep.tuning.tuner.CUDA_FP8_TILES), as "
        "grouped_gemm_fp8_select picks it on CUDA.");
  // The bounds MoeShape::validate enforces, for the fake kernels to check the same.
  m.attr("MAX_EXPERTS") = uniep::kMaxExperts;
  m.attr("MAX_WORLD_SIZE") = uniep::kMaxWorldSize;

  m.def("build_node_plan", &build_node_plan_py, py::arg("all_topk"), py::arg("num_experts"),
        py::arg("ranks_per_node"), py::arg("rank"),
        "One rank's two-level plan (uniep/node_plan.hpp) with the count exchange and the rail "
        "leg simulated in-process from every rank's routing.");
  m.def("set_group_ranks", &uniep::torch_glue::set_group_ranks, py::arg("group_name"),
        py::arg("global_ranks"),
        "Record a sub-group's global ranks (group rank order; [] forgets them): errors that name "
        "the group's ranks then say which global ranks they are. uniep.distributed records them "
        "at a group's first use.");
  m.def("group_ranks_note", &uniep::torch_glue::group_ranks_note, py::arg("group_name"),
        "What an error naming the group's ranks appends: which global ranks they are (\"\" for "
        "a group whose numbering is the global one, or one not recorded).");
  m.def("set_ranks_per_node", &uniep::torch_glue::set_ranks_per_node, py::arg("group_name"),
        py::arg("ranks_per_node"),
        "Record a group's ranks per node (0: one node) for the ops on it (uniep.init).");
  m.def("ranks_per_node", &uniep::torch_glue::ranks_per_node, py::arg("group_name"),
        "A group's ranks per node as recorded (0: none recorded, one node).");
  m.def("agree_call", &agree_call_py, py::arg("group_name"), py::arg("kind"),
        py::arg("fields") = std::vector<std::pair<std::string, int64_t>>{}, py::arg("error") = "",
        py::arg("device") = "cpu",
        "Agree with the group's other ranks on a call checked in Python (see "
        "uniep.distributed.agree_call); raises on every rank if any rank's error is set or a "
        "field differs.");
  m.def("share_call", &share_call_py, py::arg("group_name"), py::arg("kind"), py::arg("values"),
        py::arg("device") = "cpu",
        "Every rank's `values` (a flat [W * len(values)] list) through the calls' agreement "
        "message, which names a rank that is in another call instead of pairing with it.");
  m.def("coll_fail_call", &coll_fail_call_py, py::arg("group_name"), py::arg("kind"),
        py::arg("error"),
        "Join the group's agreement in the CPU collective `kind` as failed with `error` (a check "
        "made in Python): the peers raise at once naming this rank; raises ValueError(error).");
  m.def("build_info", [] {
    py::dict d;
    for (const auto& [k, v] : uniep::python::build_info_strings()) d[py::str(k)] = v;
    d["cuda_kernels"] = uniep::python::built_cuda_kernels();
    d["cuda_ops"] = uniep::python::built_cuda_ops();
    return d;
  });
#ifdef UNIEP_WITH_CUDA_OPS
  m.attr("has_ep_runtime") = true;
  m.def(
      "grouped_gemm_pingpong_rows",
      [](int device) { return uniep::cuda::grouped_gemm_pingpong_rows(device); },
      py::arg("device") = -1,
      "Rows per expert up to which the expert GEMM engine's automatic choice takes the 64-row "
      "ping-pong tiles for the SwiGLU GEMM and for k <= n on this device (by its memory "
      "bandwidth).");
  m.def("ep_unique_id", [] {
    const std::vector<uint8_t> id = uniep::torch_glue::ep_unique_id();
    return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  });
  m.def(
      "ep_create",
      [](const std::string& group_name, const py::bytes& unique_id, int64_t max_tokens,
         int64_t hidden, int64_t top_k, int64_t num_experts, int64_t world_size, int64_t rank,
         int64_t max_row_bytes, double timeout_s, int64_t ll_max_tokens) {
        uniep::ep::Config c = ep_config(max_tokens, hidden, top_k, num_experts, world_size,
                                        max_row_bytes, ll_max_tokens);
        c.rank = rank;
        c.timeout_s = timeout_s;
        const std::string raw = unique_id;
        py::gil_scoped_release release;  // collective: other ranks' threads must progress
        uniep::torch_glue::ep_create(group_name, std::vector<uint8_t>(raw.begin(), raw.end()), c);
      },
      py::arg("group_name"), py::arg("unique_id"), py::arg("max_tokens"), py::arg("hidden"),
      py::arg("top_k"), py::arg("num_experts"), py::arg("world_size"), py::arg("rank"),
      py::arg("max_row_bytes") = 0, py::arg("timeout_s") = 100.0, py::arg("ll_max_tokens") = 0);
  m.def(
      "ep_check",
      [](const std::string& group_name) {
        uniep::torch_glue::ok_or_throw(
            uniep::torch_glue::ep_runtime(group_name).check_device_errors(nullptr));
      },
      py::arg("group_name"), py::call_guard<py::gil_scoped_release>(),
      "Synchronizes the device and raises an error a device-side wait or capacity check "
      "recorded (low-latency calls do not synchronize, so they report here or at the next "
      "dispatch).");
  m.def("ep_exists", &uniep::torch_glue::ep_exists, py::arg("group_name"));
  m.def(
      "set_ep_runtime_factory",
      [](const py::function& fn) {
        // Never freed: the ops may call it until exit, when no GIL can be taken to free it.
        auto* held = new py::function(fn);
        uniep::torch_glue::set_ep_runtime_factory([held](const std::string& group_name,
                                                         int64_t tokens, int64_t hidden,
                                                         int64_t top_k, int64_t num_experts) {
          py::gil_scoped_acquire gil;
          try {
            (*held)(group_name, tokens, hidden, top_k, num_experts);
          } catch (py::error_already_set& e) {
            throw uniep::Error(uniep::StatusCode::kInvalidArgument,
                               std::string("creating the group's GPU runtime for this call "
                                           "(uniep.moe.ep.init_runtime) failed: ") +
                                   e.what());
          }
        });
      },
      py::arg("factory"),
      "The function moe_forward / moe_backward call (collectively) to create or grow a group's "
      "GPU runtime: factory(group_name, tokens, hidden, top_k, num_experts).");
  m.def(
      "ep_config",
      [](const std::string& group_name) {
        const uniep::ep::Config& c = uniep::torch_glue::ep_runtime(group_name).config();
        py::dict d;
        d["max_tokens"] = c.max_tokens;
        d["hidden"] = c.hidden;
        d["top_k"] = c.top_k;
        d["num_experts"] = c.num_experts;
        d["world_size"] = c.world_size;
        d["rank"] = c.rank;
        d["max_row_bytes"] = c.row_bytes_capacity();
        d["timeout_s"] = c.timeout_s;
        d["ll_max_tokens"] = c.ll_max_tokens;
        return d;
      },
      py::arg("group_name"), "The configuration the group's GPU runtime was created with.");
  m.def("ep_destroy", &uniep::torch_glue::ep_destroy, py::arg("group_name"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "ep_symmetric_heap_bytes",
      [](int64_t max_tokens, int64_t hidden, int64_t top_k, int64_t num_experts, int64_t world_size,
         int64_t max_row_bytes, int64_t ll_max_tokens) {
        return uniep::ep::symmetric_heap_bytes(ep_config(max_tokens, hidden, top_k, num_experts,
                                                         world_size, max_row_bytes, ll_max_tokens));
      },
      py::arg("max_tokens"), py::arg("hidden"), py::arg("top_k"), py::arg("num_experts"),
      py::arg("world_size"), py::arg("max_row_bytes") = 0, py::arg("ll_max_tokens") = 0);
  m.def(
      "coll_create",
      [](const std::string& group_name, const py::bytes& unique_id, int64_t world_size,
         int64_t rank, int64_t max_block_bytes, double timeout_s,
         const std::vector<int64_t>& members) {
        uniep::coll::Config c;
        c.world_size = world_size;
        c.rank = rank;
        c.max_block_bytes = max_block_bytes;
        c.timeout_s = timeout_s;
        c.members = members;
        const std::string raw = unique_id;
        py::gil_scoped_release release;  // collective: other ranks' threads must progress
        uniep::torch_glue::coll_create(group_name, std::vector<uint8_t>(raw.begin(), raw.end()), c);
      },
      py::arg("group_name"), py::arg("unique_id"), py::arg("world_size"), py::arg("rank"),
      py::arg("max_block_bytes"), py::arg("timeout_s") = 100.0,
      py::arg("members") = std::vector<int64_t>{});
  m.def("coll_exists", &uniep::torch_glue::coll_exists, py::arg("group_name"));
  m.def("coll_set_gemm", &uniep::torch_glue::set_coll_gemm, py::arg("backend"),
        py::arg("sm_carveout"));
  m.def("coll_gemm", [] {
    const uniep::torch_glue::CollGemm g = uniep::torch_glue::coll_gemm();
    return py::make_tuple(std::string(uniep::torch_glue::coll_gemm_backend_name(g.backend)),
                          g.sm_carveout);
  });
  m.def("coll_destroy", &uniep::torch_glue::coll_destroy, py::arg("group_name"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "coll_check",
      [](const std::string& group_name, bool synchronize) {
        uniep::torch_glue::ok_or_throw(
            uniep::torch_glue::coll_runtime(group_name).check_device_errors(synchronize));
      },
      py::arg("group_name"), py::arg("synchronize") = true,
      py::call_guard<py::gil_scoped_release>(),
      "Raises the error a device-side wait of the group's collectives recorded (the CUDA "
      "collectives never synchronize: a timeout reports here or at the next call).");
  m.def(
      "coll_config",
      [](const std::string& group_name) {
        const uniep::coll::Config& c = uniep::torch_glue::coll_runtime(group_name).config();
        py::dict d;
        d["world_size"] = c.world_size;
        d["rank"] = c.rank;
        d["max_block_bytes"] = c.max_block_bytes;
        d["timeout_s"] = c.timeout_s;
        return d;
      },
      py::arg("group_name"));
  m.def(
      "coll_symmetric_heap_bytes",
      [](int64_t world_size, int64_t max_block_bytes) {
        uniep::coll::Config c;
        c.world_size = world_size;
        c.max_block_bytes = max_block_bytes;
        return static_cast<int64_t>(uniep::coll::symmetric_heap_bytes(c));
      },
      py::arg("world_size"), py::arg("max_block_bytes"),
      "Bytes of NVSHMEM symmetric heap a collectives runtime of these parameters allocates.");
  m.def(
      "fused_ep_create",
      [](const std::string& group_name, const py::bytes& unique_id, int64_t world_size,
         int64_t rank, int64_t max_tokens, int64_t hidden, int64_t ffn, int64_t top_k,
         int64_t num_experts, double timeout_s, int64_t tile_m, bool backward) {
        const uniep::fused::Config c =
            fused_config(world_size, rank, max_tokens, hidden, ffn, top_k, num_experts, timeout_s,
                         tile_m, backward);
        const std::string raw = unique_id;
        py::gil_scoped_release release;  // collective: other ranks' threads must progress
        uniep::torch_glue::fused_ep_create(group_name, std::vector<uint8_t>(raw.begin(), raw.end()),
                                           c);
      },
      py::arg("group_name"), py::arg("unique_id"), py::arg("world_size"), py::arg("rank"),
      py::arg("max_tokens"), py::arg("hidden"), py::arg("ffn"), py::arg("top_k"),
      py::arg("num_experts"), py::arg("timeout_s") = 100.0, py::arg("tile_m") = 128,
      py::arg("backward") = false);
  m.def("fused_ep_exists", &uniep::torch_glue::fused_ep_exists, py::arg("group_name"));
  m.def("fused_ep_destroy", &uniep::torch_glue::fused_ep_destroy, py::arg("group_name"),
        py::call_guard<py::gil_scoped_release>());
  m.def(
      "fused_ep_config",
      [](const std::string& group_name) {
        const uniep::fused::Config& c = uniep::torch_glue::fused_ep_runtime(group_name).config();
        py::dict d;
        d["world_size"] = c.world_size;
        d["rank"] = c.rank;
        d["max_tokens"] = c.max_tokens;
        d["hidden"] = c.hidden;
        d["ffn"] = c.ffn;
        d["top_k"] = c.top_k;
        d["num_experts"] = c.num_experts;
        d["timeout_s"] = c.timeout_s;
        d["tile_m"] = c.tile_m;
        d["backward"] = c.backward;
        d["row_capacity"] = c.row_capacity();
        return d;
      },
      py::arg("group_name"), "The configuration the group's fused MoE runtime was created with.");
  m.def(
      "fused_ep_symmetric_heap_bytes",
      [](int64_t world_size, int64_t max_tokens, int64_t hidden, int64_t ffn, int64_t top_k,
         int64_t num_experts, int64_t tile_m, bool backward) {
        const uniep::fused::Config c = fused_config(world_size, 0, max_tokens, hidden, ffn, top_k,
                                                    num_experts, 100.0, tile_m, backward);
        uniep::torch_glue::ok_or_throw(c.validate());
        return static_cast<int64_t>(uniep::fused::symmetric_heap_bytes(c));
      },
      py::arg("world_size"), py::arg("max_tokens"), py::arg("hidden"), py::arg("ffn"),
      py::arg("top_k"), py::arg("num_experts"), py::arg("tile_m") = 128,
      py::arg("backward") = false,
      "Bytes of NVSHMEM symmetric heap a fused MoE runtime of these parameters allocates.");
  m.def("clear_fp8_experts", &uniep::torch_glue::clear_fp8_experts,
        "Drops the e4m3 copies of expert weights that moe_forward keeps for fp8 experts "
        "(tuning dispatch=fp8): after writes their version counters do not see.");
#else
  m.attr("has_ep_runtime") = false;
  m.def("clear_fp8_experts", [] {}, "No fp8 expert copies are kept without CUDA ops.");
#endif
  bind_collectives(m);
  bind_parm(m);
  m.def("compute_layout", &compute_layout_py, py::arg("topk_idx"), py::arg("num_experts"),
        py::arg("world_size"),
        "Routing layout of one rank: (tokens_per_rank [W], tokens_per_expert [E], "
        "token_in_rank uint8 [T, W]).");
  m.def("encode_fp8_rows", &encode_fp8_rows_py, py::arg("x"),
        "fp8 e4m3 rows with one fp32 scale per 1x128 block, as the executors send them: "
        "(q uint8 [N, H], scales float32 [N, ceil(H / 128)]).");
  m.def(
      "send_rows_error_message",
      [](int64_t word, int64_t top_k, const std::string& what) {
        const Status s = send_rows_error_status(static_cast<uint64_t>(word), top_k, what.c_str());
        return s.ok() ? std::string() : s.message;
      },
      py::arg("word"), py::arg("top_k"), py::arg("what"),
      "The message of a sender_rows / send_rows error word ('' for 0): the failing entry and "
      "why.");
  m.def(
      "send_rows_error_word",
      [](int64_t code, int64_t entry) {
        return static_cast<int64_t>(send_error_word(static_cast<uint64_t>(code), entry));
      },
      py::arg("code"), py::arg("entry"),
      "The error word of a failing entry: (code << 48) | entry.");
  m.attr("SEND_ROW_OUT_OF_RANGE") = static_cast<int64_t>(kSendRowOutOfRange);
  m.def("build_rank_plan", &build_rank_plan_py, py::arg("all_topk"), py::arg("num_experts"),
        py::arg("rank"), py::arg("tuning") = "", py::arg("gate_tile_m") = 128,
        "The plan of `rank` given every rank's topk_idx, with the exchanges simulated in-process "
        "(send_gate_counter: tile gate counters of gate_tile_m-row tiles).");
}
