// torch.ops.uniep collectives (schemas and CPU implementations): the P2P-decomposed all-gather +
// GEMM, GEMM + reduce-scatter, all-gather, reduce-scatter and Ulysses all-to-all, run by the CPU
// executor over a gloo process group. Fake kernels and autograd live in uniep/collectives.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "torch/collectives/peer_transport.hpp"
#include "torch/common/process_group.hpp"
#include "torch/common/validate.hpp"
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
  // a [M, K] @ b [K, N] (+ c [M, N]) -> [M, N] on UniEP's Hopper GEMM (bf16, CUDA only), the one
  // the collectives run with set_gemm("cutlass"); its grid leaves sm_carveout SMs free. tile_n
  // (128, 256), swizzle (1, 2, 4, 8) and raster ("m", "n") override the kernel's own choice.
  m.def(
      "sm90_gemm(Tensor a, Tensor b, Tensor? c=None, int sm_carveout=0, int tile_n=0, "
      "int swizzle=0, str raster=\"auto\") -> Tensor");
  // a [M, K] @ b [K, N] -> [M, N] as `parts` row blocks of one persistent gated GEMM (bf16, CUDA
  // only): the GEMM that set_gemm("gated") runs for an all-gather + GEMM. With ready (int64
  // [parts], device words) the tiles of block i load once ready[i] >= epoch (compared unsigned);
  // the op then synchronizes and raises a timeout naming the first block that never got there.
  // swizzle and raster order the tiles (as sm90_gemm's); tile_n (128, 256) overrides the tile
  // width's choice. For tests and benchmarks of the gated GEMM at world 1.
  m.def(
      "part_gemm(Tensor a, Tensor b, int parts=1, Tensor? ready=None, int epoch=0, "
      "float timeout_s=10.0, int sm_carveout=0, int swizzle=0, str raster=\"auto\", "
      "int tile_n=0) -> Tensor");
}

namespace uniep::torch_glue {
namespace {

void check_chunks(int64_t chunks, int64_t rows, const char* rows_desc) {
  UNIEP_CHECK(chunks >= 1, "chunks must be >= 1, got ", chunks);
  UNIEP_CHECK(rows % chunks == 0, "chunks (", chunks, ") must divide ", rows_desc, " (", rows, ")");
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

std::tuple<at::Tensor, at::Tensor> all_gather_matmul_cpu(const at::Tensor& a, const at::Tensor& b,
                                                         c10::string_view group_name,
                                                         int64_t chunks, c10::string_view order) {
  return translate_errors_on(group_name, [&] {
    const CollectiveKind kind = CollectiveKind::kAllGatherMatmul;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    AllGatherArgs args;
    at::Tensor ac, bc, ag, mm;
    checked(kind, call, [&] {
      check_matmul_operands(a, b, "[M/W, K]", "[K, N]", Executor::kCpu);
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
  return translate_errors_on(group_name, [&] {
    const CollectiveKind kind = CollectiveKind::kMatmulReduceScatter;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    ReduceScatterArgs args;
    at::Tensor ac, bc, out;
    checked(kind, call, [&] {
      check_matmul_operands(a, b, "[M, K_local]", "[K_local, N]", Executor::kCpu);
      args.order = parse_peer_order(std::string(order));
      const int64_t rows = matmul_reduce_scatter_rows(a, W);
      check_chunks(chunks, rows, "M / world size, the rows of this rank's output");
      ac = a.contiguous();
      bc = b.contiguous();
      out = at::empty({rows, b.size(1)}, a.options());
      args.a = ac.data_ptr();
      args.b = bc.data_ptr();
      args.out = out.data_ptr();
      args.dtype = to_dtype(a, "a");
      args.rows_per_rank = rows;
      args.k = a.size(1);
      args.n = b.size(1);
      args.chunks = chunks;
    });
    cpu_reduce_scatter(kind, args, *call.transport);
    return out;
  });
}

at::Tensor all_gather_cpu(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                          c10::string_view order) {
  return translate_errors_on(group_name, [&] {
    const CollectiveKind kind = CollectiveKind::kAllGather;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    AllGatherArgs args;
    at::Tensor xc, out;
    checked(kind, call, [&] {
      check_rows_input(x, Executor::kCpu);
      args.order = parse_peer_order(std::string(order));
      check_chunks(chunks, x.size(0), "x.size(0), the rows of this rank's shard");
      xc = x.contiguous();
      out = empty_with_rows(x, W * x.size(0));
      args.a = xc.data_ptr();
      args.gathered = out.data_ptr();
      args.dtype = to_dtype(x, "x");
      args.rows_per_rank = x.size(0);
      args.k = row_width(x);
      args.chunks = chunks;
      args.shape = x.sizes().vec();
    });
    cpu_all_gather(kind, args, *call.transport);
    return out;
  });
}

at::Tensor reduce_scatter_cpu(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                              c10::string_view order) {
  return translate_errors_on(group_name, [&] {
    const CollectiveKind kind = CollectiveKind::kReduceScatter;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    ReduceScatterArgs args;
    at::Tensor xc, out;
    checked(kind, call, [&] {
      check_rows_input(x, Executor::kCpu);
      args.order = parse_peer_order(std::string(order));
      const int64_t rows = reduce_scatter_rows(x, W);
      check_chunks(chunks, rows, "x.size(0) / world size, the rows of this rank's output");
      xc = x.contiguous();
      out = empty_with_rows(x, rows);
      args.a = xc.data_ptr();
      args.out = out.data_ptr();
      args.dtype = to_dtype(x, "x");
      args.rows_per_rank = rows;
      args.n = row_width(x);
      args.chunks = chunks;
      args.shape = x.sizes().vec();
    });
    cpu_reduce_scatter(kind, args, *call.transport);
    return out;
  });
}

at::Tensor all_to_all_ulysses_cpu(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                                  c10::string_view group_name) {
  return translate_errors_on(group_name, [&] {
    const CollectiveKind kind = CollectiveKind::kAllToAllUlysses;
    Call call = open_call(group_name);
    const int64_t W = call.group.world_size;
    AllToAllArgs args;
    at::Tensor xc, send, recv, out;
    UlyssesLayout layout;
    checked(kind, call, [&] {
      check_ulysses_input(x, Executor::kCpu);
      const UlyssesDims dims = ulysses_dims(x, scatter_dim, gather_dim);
      xc = x.contiguous();
      layout = ulysses_tensor_layout(xc, dims, W);
      send = at::empty({W, layout.block_bytes}, x.options().dtype(at::kByte));
      recv = at::empty_like(send);
      out = at::empty(layout.out_shape, x.options());
      pack_blocks(layout.send, W, xc.data_ptr(), send.data_ptr());
      args.send = send.data_ptr();
      args.recv = recv.data_ptr();
      args.dtype = to_dtype(x, "x");
      args.block_bytes = layout.block_bytes;
      args.shape = x.sizes().vec();
      args.scatter_dim = dims.scatter;
      args.gather_dim = dims.gather;
    });
    cpu_all_to_all(args, *call.transport);
    unpack_blocks(layout.recv, W, recv.data_ptr(), out.data_ptr());
    return out;
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
