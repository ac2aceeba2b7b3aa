// torch.ops.uniep collectives (schemas and CPU implementations): the P2P-decomposed all-gather +
// GEMM, GEMM + reduce-scatter, all-gather, reduce-scatter and Ulysses all-to-all, run by the CPU
// executor over a gloo process group. Fake kernels and autograd live in uniep/collectives.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "torch/peer_transport.hpp"
#include "torch/process_group.hpp"
#include "torch/validate.hpp"
#include "uniep/collectives.hpp"

TORCH_LIBRARY_FRAGMENT(uniep, m) {
  // a [M/W, K] (this rank's rows), b [K, N] -> ag_out [M, K] (a of every rank, rank order),
  // mm_out [M, N] = ag_out @ b. torch's fused_all_gather_matmul with gather_dim 0.
  m.def(
      "all_gather_matmul(Tensor a, Tensor b, str group_name, int chunks=1, "
      "str order=\"direct\") -> (Tensor ag_out, Tensor mm_out)");
  // a [M, K_local], b [K_local, N] -> [M/W, N]: this rank's rows of the sum over ranks of a @ b.
  m.def(
      "matmul_reduce_scatter(Tensor a, Tensor b, str group_name, int chunks=1, "
      "str order=\"direct\") -> Tensor");
  // x [m, ...] -> [W*m, ...] (dim 0, rank order).
  m.def("all_gather(Tensor x, str group_name, int chunks=1, str order=\"direct\") -> Tensor");
  // x [W*m, ...] -> [m, ...]: this rank's rows of the sum over ranks.
  m.def("reduce_scatter(Tensor x, str group_name, int chunks=1, str order=\"direct\") -> Tensor");
  // Splits x along scatter_dim into W blocks, block p to rank p; concatenates the blocks received
  // along gather_dim in rank order. [S/W, H, D] (1, 0) -> [S, H/W, D] and back with (0, 1).
  m.def("all_to_all_ulysses(Tensor x, int scatter_dim, int gather_dim, str group_name) -> Tensor");
}

namespace uniep::torch_glue {
namespace {

std::string shape_str(const at::Tensor& t) {
  return detail::str_cat(t.sizes());
}

void check_cpu(const at::Tensor& t, const char* name) {
  UNIEP_CHECK(t.device().is_cpu(), name, " must be a CPU tensor for the CPU executor, got ",
              t.device());
}

void check_chunks(int64_t chunks, int64_t rows, const char* rows_desc) {
  UNIEP_CHECK(chunks >= 1, "chunks must be >= 1, got ", chunks);
  UNIEP_CHECK(rows % chunks == 0, "chunks (", chunks, ") must divide ", rows_desc, " (", rows, ")");
}

// Elements of one row of dim 0 (1 for a 1-D tensor).
int64_t row_width(const at::Tensor& x) {
  int64_t w = 1;
  for (int64_t d = 1; d < x.dim(); ++d) w *= x.size(d);
  return w;
}

// Everything an op needs once its arguments are checked; the transport exists before the checks
// so that a failed check can still take part in the agreement with the peers.
struct Call {
  Group group;
  std::unique_ptr<PeerTransport> transport;
};

Call open_call(c10::string_view group_name) {
  Call c;
  c.group = resolve_group(std::string(group_name));
  c.transport = make_peer_transport(c.group);
  return c;
}

// Runs the checks; if one fails with a bad argument, the peers are told before it is rethrown.
template <typename Checks>
auto checked(CollectiveKind kind, Call& call, Checks checks) -> decltype(checks()) {
  try {
    return checks();
  } catch (const Error& e) {
    if (e.code() == StatusCode::kInvalidArgument) fail_collective_call(kind, e, *call.transport);
    throw;
  }
}

void check_pair(const at::Tensor& a, const at::Tensor& b, const char* a_shape,
                const char* b_shape) {
  UNIEP_CHECK(a.dim() == 2, "a must be a 2-D tensor ", a_shape, ", got shape ", shape_str(a));
  to_dtype(a, "a");
  check_cpu(a, "a");
  UNIEP_CHECK(b.dim() == 2, "b must be a 2-D tensor ", b_shape, ", got shape ", shape_str(b));
  UNIEP_CHECK(b.scalar_type() == a.scalar_type(), "b must have a's dtype ", a.scalar_type(),
              ", got ", b.scalar_type());
  check_cpu(b, "b");
  UNIEP_CHECK(b.size(0) == a.size(1), "b must be ", b_shape, " with K = a.size(1) = ", a.size(1),
              " rows, got shape ", shape_str(b));
}

std::tuple<at::Tensor, at::Tensor> all_gather_matmul_cpu(const at::Tensor& a, const at::Tensor& b,
                                                         c10::string_view group_name,
                                                         int64_t chunks, c10::string_view order) {
  return translate_errors([&] {
    const CollectiveKind kind = CollectiveKind::kAllGatherMatmul;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    AllGatherArgs args;
    at::Tensor ac, bc, ag, mm;
    checked(kind, call, [&] {
      check_pair(a, b, "[M/W, K]", "[K, N]");
      args.order = parse_peer_order(std::string(order));
      check_chunks(chunks, a.size(0), "a.size(0), the rows of this rank's shard");
      ac = a.contiguous();
      bc = b.contiguous();
      ag = at::empty({W * a.size(0), a.size(1)}, a.options());
      mm = at::empty({W * a.size(0), b.size(1)}, a.options());
      args.a = ac.data_ptr();
      args.b = bc.data_ptr();
      args.gathered = ag.data_ptr();
      args.out = mm.data_ptr();
      args.dtype = to_dtype(a, "a");
      args.rows_per_rank = a.size(0);
      args.k = a.size(1);
      args.n = b.size(1);
      args.chunks = chunks;
    });
    cpu_all_gather(kind, args, *call.transport);
    return std::make_tuple(ag, mm);
  });
}

at::Tensor matmul_reduce_scatter_cpu(const at::Tensor& a, const at::Tensor& b,
                                     c10::string_view group_name, int64_t chunks,
                                     c10::string_view order) {
  return translate_errors([&] {
    const CollectiveKind kind = CollectiveKind::kMatmulReduceScatter;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    ReduceScatterArgs args;
    at::Tensor ac, bc, out;
    checked(kind, call, [&] {
      check_pair(a, b, "[M, K_local]", "[K_local, N]");
      args.order = parse_peer_order(std::string(order));
      UNIEP_CHECK(a.size(0) % W == 0, "a.size(0) (M = ", a.size(0),
                  ") must be divisible by the world size ", W);
      check_chunks(chunks, a.size(0) / W, "M / world size, the rows of this rank's output");
      ac = a.contiguous();
      bc = b.contiguous();
      out = at::empty({a.size(0) / W, b.size(1)}, a.options());
      args.a = ac.data_ptr();
      args.b = bc.data_ptr();
      args.out = out.data_ptr();
      args.dtype = to_dtype(a, "a");
      args.rows_per_rank = a.size(0) / W;
      args.k = a.size(1);
      args.n = b.size(1);
      args.chunks = chunks;
    });
    cpu_reduce_scatter(kind, args, *call.transport);
    return out;
  });
}

void check_x(const at::Tensor& x) {
  UNIEP_CHECK(x.dim() >= 1,
              "x must have at least 1 dimension (dim 0 is split across ranks), got "
              "a 0-d tensor");
  to_dtype(x, "x");
  check_cpu(x, "x");
}

at::Tensor all_gather_cpu(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                          c10::string_view order) {
  return translate_errors([&] {
    const CollectiveKind kind = CollectiveKind::kAllGather;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    AllGatherArgs args;
    at::Tensor xc, out;
    checked(kind, call, [&] {
      check_x(x);
      args.order = parse_peer_order(std::string(order));
      check_chunks(chunks, x.size(0), "x.size(0), the rows of this rank's shard");
      xc = x.contiguous();
      std::vector<int64_t> shape = x.sizes().vec();
      shape[0] *= W;
      out = at::empty(shape, x.options());
      args.a = xc.data_ptr();
      args.gathered = out.data_ptr();
      args.dtype = to_dtype(x, "x");
      args.rows_per_rank = x.size(0);
      args.k = row_width(x);
      args.chunks = chunks;
    });
    cpu_all_gather(kind, args, *call.transport);
    return out;
  });
}

at::Tensor reduce_scatter_cpu(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                              c10::string_view order) {
  return translate_errors([&] {
    const CollectiveKind kind = CollectiveKind::kReduceScatter;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    ReduceScatterArgs args;
    at::Tensor xc, out;
    checked(kind, call, [&] {
      check_x(x);
      args.order = parse_peer_order(std::string(order));
      UNIEP_CHECK(x.size(0) % W == 0, "x.size(0) (", x.size(0),
                  ") must be divisible by the world size ", W);
      check_chunks(chunks, x.size(0) / W, "x.size(0) / world size, the rows of this rank's output");
      xc = x.contiguous();
      std::vector<int64_t> shape = x.sizes().vec();
      shape[0] /= W;
      out = at::empty(shape, x.options());
      args.a = xc.data_ptr();
      args.out = out.data_ptr();
      args.dtype = to_dtype(x, "x");
      args.rows_per_rank = x.size(0) / W;
      args.n = row_width(x);
      args.chunks = chunks;
    });
    cpu_reduce_scatter(kind, args, *call.transport);
    return out;
  });
}

int64_t normalize_dim(int64_t dim, int64_t rank, const char* name) {
  UNIEP_CHECK(dim >= -rank && dim < rank, name, " must be in [", -rank, ", ", rank,
              ") for a tensor of ", rank, " dimensions, got ", dim);
  return dim < 0 ? dim + rank : dim;
}

at::Tensor all_to_all_ulysses_cpu(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                                  c10::string_view group_name) {
  return translate_errors([&] {
    const CollectiveKind kind = CollectiveKind::kAllToAllUlysses;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    AllToAllArgs args;
    at::Tensor send, recv;
    int64_t gd = 0;
    checked(kind, call, [&] {
      UNIEP_CHECK(x.dim() >= 2,
                  "x must have at least 2 dimensions (one to scatter, one to gather), got shape ",
                  shape_str(x));
      to_dtype(x, "x");
      check_cpu(x, "x");
      const int64_t sd = normalize_dim(scatter_dim, x.dim(), "scatter_dim");
      gd = normalize_dim(gather_dim, x.dim(), "gather_dim");
      UNIEP_CHECK(sd != gd, "scatter_dim and gather_dim must differ, both are dimension ", sd);
      UNIEP_CHECK(x.size(sd) % W == 0, "x.size(scatter_dim = ", sd, ") (", x.size(sd),
                  ") must be divisible by the world size ", W);
      // [W, block...]: block p is what rank p receives from here.
      send = at::stack(x.tensor_split(W, sd), 0).contiguous();
      recv = at::empty_like(send);
      args.send = send.data_ptr();
      args.recv = recv.data_ptr();
      args.dtype = to_dtype(x, "x");
      args.block_bytes = send.numel() / W * send.element_size();
    });
    cpu_all_to_all(args, *call.transport);
    return at::cat(recv.unbind(0), gd);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CPU, m) {
  m.impl("all_gather_matmul", &uniep::torch_glue::all_gather_matmul_cpu);
  m.impl("matmul_reduce_scatter", &uniep::torch_glue::matmul_reduce_scatter_cpu);
  m.impl("all_gather", &uniep::torch_glue::all_gather_cpu);
  m.impl("reduce_scatter", &uniep::torch_glue::reduce_scatter_cpu);
  m.impl("all_to_all_ulysses", &uniep::torch_glue::all_to_all_ulysses_cpu);
}
