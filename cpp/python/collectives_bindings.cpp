// uniep._C bindings of the collective schedules: the plans the executors run, for tests and for
// anyone writing another executor.
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>

#include "uniep/collectives.hpp"

namespace py = pybind11;

void bind_collectives(py::module& m) {
  using namespace uniep;

  py::class_<Transfer>(m, "Transfer", "One chunk to (sends) or from (receives, waits) a peer.")
      .def(py::init<int64_t, int64_t>(), py::arg("peer"), py::arg("chunk"))
      .def_readwrite("peer", &Transfer::peer)
      .def_readwrite("chunk", &Transfer::chunk)
      .def(py::self == py::self)
      .def("__hash__", [](const Transfer& t) { return py::hash(py::make_tuple(t.peer, t.chunk)); })
      .def("__repr__", [](const Transfer& t) {
        return "Transfer(peer=" + std::to_string(t.peer) + ", chunk=" + std::to_string(t.chunk) +
               ")";
      });

  py::class_<ChunkStep>(m, "ChunkStep",
                        "One step of a schedule: transfers issued when it starts, the chunk it "
                        "computes (-1: none), the arrivals its compute waits on before starting "
                        "(input_waits) and folds in its epilogue, in order (fold_waits).")
      .def(py::init<>())
      .def_readwrite("sends", &ChunkStep::sends)
      .def_readwrite("recvs", &ChunkStep::recvs)
      .def_readwrite("compute", &ChunkStep::compute)
      .def_readwrite("input_waits", &ChunkStep::input_waits)
      .def_readwrite("fold_waits", &ChunkStep::fold_waits)
      .def("has_transfers", &ChunkStep::has_transfers);

  py::class_<CollectiveSchedule>(m, "CollectiveSchedule",
                                 "The plan of one rank (see include/uniep/collectives.hpp).")
      .def_property_readonly(
          "kind",
          [](const CollectiveSchedule& s) { return std::string(collective_kind_name(s.kind)); })
      .def_property_readonly(
          "order",
          [](const CollectiveSchedule& s) { return std::string(peer_order_name(s.order)); })
      .def_readonly("world_size", &CollectiveSchedule::world_size)
      .def_readonly("rank", &CollectiveSchedule::rank)
      .def_readonly("chunks_per_rank", &CollectiveSchedule::chunks_per_rank)
      .def_readwrite("steps", &CollectiveSchedule::steps)
      .def_property_readonly("num_chunks", &CollectiveSchedule::num_chunks)
      .def("chunk_block", &CollectiveSchedule::chunk_block, py::arg("chunk"),
           "Owner (gather kinds), destination (reduce kinds) or src * W + dst (all-to-all).")
      .def("chunk_part", &CollectiveSchedule::chunk_part, py::arg("chunk"))
      .def("chunk_id", &CollectiveSchedule::chunk_id, py::arg("block"), py::arg("part"))
      .def("__repr__", [](const CollectiveSchedule& s) {
        return std::string("CollectiveSchedule(") + collective_kind_name(s.kind) + ", " +
               peer_order_name(s.order) + ", world_size=" + std::to_string(s.world_size) +
               ", rank=" + std::to_string(s.rank) +
               ", chunks=" + std::to_string(s.chunks_per_rank) +
               ", steps=" + std::to_string(s.steps.size()) + ")";
      });

  m.def(
      "collective_schedule",
      [](const std::string& kind, int64_t world_size, int64_t rank, int64_t chunks,
         const std::string& order) {
        return make_schedule(parse_collective_kind(kind), world_size, rank, chunks,
                             parse_peer_order(order));
      },
      py::arg("kind"), py::arg("world_size"), py::arg("rank"), py::arg("chunks") = 1,
      py::arg("order") = "direct",
      "The schedule of `rank`: kind is all_gather_matmul, matmul_reduce_scatter, all_gather, "
      "reduce_scatter or all_to_all_ulysses; order is direct or ring.");
  m.def("validate_schedules", &validate_schedules, py::arg("ranks"),
        "Checks the schedules of every rank of one world (matching, data flow, reduce order, "
        "tail-free); raises RuntimeError naming the rank, step and chunk of the first violation.");
  m.def("reduce_order", &reduce_order, py::arg("world_size"), py::arg("dest"),
        "Ranks whose contributions the reduce-scatter kinds add for `dest`, in order.");
}
