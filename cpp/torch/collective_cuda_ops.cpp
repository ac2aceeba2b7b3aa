// CUDA implementations of the collective ops (schemas in collective_ops.cpp) over the NVSHMEM
// collectives runtime: argument checks, output allocation, and the GEMM of a row range as
// at::mm_out on the caller's stream, which the runtime's schedule interleaves with its copies.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "torch/coll_registry.hpp"
#include "torch/runtime_registry.hpp"
#include "torch/validate.hpp"
#include "uniep/cuda/collectives.hpp"

namespace uniep::torch_glue {
namespace {

RuntimeRegistry<coll::Runtime>& registry() {
  static auto* r = new RuntimeRegistry<coll::Runtime>(
      "collectives runtime on CUDA",
      "call uniep.collectives.shutdown_cuda(group) first to re-create it",
      "call uniep.collectives.init_cuda(group, max_block_bytes=...) on every rank first");
  return *r;
}

}  // namespace

void coll_create(const std::string& group_name, const std::vector<uint8_t>& unique_id,
                 const coll::Config& config) {
  registry().create(group_name, unique_id, config);
}

bool coll_exists(const std::string& group_name) {
  return registry().exists(group_name);
}

void coll_destroy(const std::string& group_name) {
  registry().destroy(group_name);
}

coll::Runtime& coll_runtime(const std::string& group_name) {
  return registry().get(group_name);
}

namespace {

void check_direct(c10::string_view order) {
  UNIEP_CHECK(order == "direct" || order == "ring", "order must be \"direct\" or \"ring\", got \"",
              std::string(order), "\"");
  UNIEP_CHECK(order == "direct",
              "order=\"ring\" runs on the CPU executor only; the CUDA executor addresses every "
              "peer of its NVLink domain directly (order=\"direct\")");
}

// The runtime was created for this group's ranks (init_cuda), so its world size is the group's.
coll::Runtime& runtime_for(c10::string_view group_name) {
  return coll_runtime(std::string(group_name));
}

// The input's device made current and the group's runtime, for as long as an op runs. Opened
// after the argument checks, so that a bad argument is reported ahead of a missing runtime.
struct OpScope {
  OpScope(const at::Tensor& input, c10::string_view group_name)
      : guard(input.device()), rt(runtime_for(group_name)) {}
  const c10::cuda::CUDAGuard guard;
  coll::Runtime& rt;
};

// The GEMM of a row range: out[rows] = a[rows] @ b on the current stream, which is the stream
// the runtime was handed.
struct MmContext {
  at::Tensor b;
  int64_t k = 0;
  at::TensorOptions options;
};

Status mm_rows(void* ctx, const void* a_rows, void* out_rows, int64_t rows, cudaStream_t stream) {
  auto* c = static_cast<MmContext*>(ctx);
  if (stream != at::cuda::getCurrentCUDAStream().stream())
    return {StatusCode::kInternal, "the GEMM callback runs on the current stream only"};
  try {
    at::Tensor a = at::from_blob(const_cast<void*>(a_rows), {rows, c->k}, c->options);
    at::Tensor out = at::from_blob(out_rows, {rows, c->b.size(1)}, c->options);
    at::mm_out(out, a, c->b);
  } catch (const std::exception& e) {
    return {StatusCode::kInternal, detail::str_cat("GEMM of a chunk failed: ", e.what())};
  }
  return Status::Ok();
}

std::tuple<at::Tensor, at::Tensor> all_gather_matmul_cuda(const at::Tensor& a, const at::Tensor& b,
                                                          c10::string_view group_name,
                                                          int64_t chunks, c10::string_view order) {
  return translate_errors([&] {
    check_matmul_operands(a, b, "[M/W, K]", "[K, N]", Executor::kCuda);
    check_direct(order);
    const OpScope scope(a, group_name);
    const int64_t W = scope.rt.config().world_size;
    at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor ag = at::empty({W * a.size(0), a.size(1)}, a.options());
    at::Tensor mm = at::empty({W * a.size(0), b.size(1)}, a.options());
    MmContext ctx{bc, a.size(1), a.options()};
    coll::AllGatherCall c;
    c.a = ac.data_ptr();
    c.gathered = ag.data_ptr();
    c.rows_per_rank = a.size(0);
    c.row_bytes = a.size(1) * a.element_size();
    c.chunks = chunks;
    c.gemm = {&mm_rows, &ctx};
    c.out = mm.data_ptr();
    c.out_row_bytes = b.size(1) * a.element_size();
    ok_or_throw(scope.rt.all_gather(c, at::cuda::getCurrentCUDAStream().stream()));
    return std::make_tuple(ag, mm);
  });
}

at::Tensor matmul_reduce_scatter_cuda(const at::Tensor& a, const at::Tensor& b,
                                      c10::string_view group_name, int64_t chunks,
                                      c10::string_view order) {
  return translate_errors([&] {
    check_matmul_operands(a, b, "[M, K_local]", "[K_local, N]", Executor::kCuda);
    check_direct(order);
    const OpScope scope(a, group_name);
    const int64_t rows = matmul_reduce_scatter_rows(a, scope.rt.config().world_size);
    at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor scratch = at::empty({a.size(0), b.size(1)}, a.options());
    at::Tensor out = at::empty({rows, b.size(1)}, a.options());
    MmContext ctx{bc, a.size(1), a.options()};
    coll::ReduceScatterCall c;
    c.dtype = to_dtype(a, "a");
    c.a = ac.data_ptr();
    c.a_row_bytes = a.size(1) * a.element_size();
    c.scratch = scratch.data_ptr();
    c.out = out.data_ptr();
    c.rows_per_rank = rows;
    c.n = b.size(1);
    c.chunks = chunks;
    c.gemm = {&mm_rows, &ctx};
    ok_or_throw(scope.rt.reduce_scatter(c, at::cuda::getCurrentCUDAStream().stream()));
    return out;
  });
}

at::Tensor all_gather_cuda(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                           c10::string_view order) {
  return translate_errors([&] {
    check_rows_input(x, Executor::kCuda);
    check_direct(order);
    const OpScope scope(x, group_name);
    at::Tensor xc = x.contiguous();
    at::Tensor out = empty_with_rows(x, scope.rt.config().world_size * x.size(0));
    coll::AllGatherCall c;
    c.a = xc.data_ptr();
    c.gathered = out.data_ptr();
    c.rows_per_rank = x.size(0);
    c.row_bytes = row_width(x) * x.element_size();
    c.chunks = chunks;
    ok_or_throw(scope.rt.all_gather(c, at::cuda::getCurrentCUDAStream().stream()));
    return out;
  });
}

at::Tensor reduce_scatter_cuda(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                               c10::string_view order) {
  return translate_errors([&] {
    check_rows_input(x, Executor::kCuda);
    check_direct(order);
    const OpScope scope(x, group_name);
    const int64_t rows = reduce_scatter_rows(x, scope.rt.config().world_size);
    at::Tensor xc = x.contiguous();
    at::Tensor out = empty_with_rows(x, rows);
    coll::ReduceScatterCall c;
    c.dtype = to_dtype(x, "x");
    c.a = xc.data_ptr();
    c.a_row_bytes = row_width(x) * x.element_size();
    c.out = out.data_ptr();
    c.rows_per_rank = rows;
    c.n = row_width(x);
    c.chunks = chunks;
    ok_or_throw(scope.rt.reduce_scatter(c, at::cuda::getCurrentCUDAStream().stream()));
    return out;
  });
}

at::Tensor all_to_all_ulysses_cuda(const at::Tensor& x, int64_t scatter_dim, int64_t gather_dim,
                                   c10::string_view group_name) {
  return translate_errors([&] {
    check_ulysses_input(x, Executor::kCuda);
    const OpScope scope(x, group_name);
    const int64_t W = scope.rt.config().world_size;
    const UlyssesDims dims = ulysses_dims(x, scatter_dim, gather_dim, W);
    at::Tensor send = ulysses_send_blocks(x, dims, W);
    at::Tensor recv = at::empty_like(send);
    coll::AllToAllCall c;
    c.send = send.data_ptr();
    c.recv = recv.data_ptr();
    c.block_bytes = send.numel() / W * send.element_size();
    ok_or_throw(scope.rt.all_to_all(c, at::cuda::getCurrentCUDAStream().stream()));
    return ulysses_output(recv, dims);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("all_gather_matmul", &uniep::torch_glue::all_gather_matmul_cuda);
  m.impl("matmul_reduce_scatter", &uniep::torch_glue::matmul_reduce_scatter_cuda);
  m.impl("all_gather", &uniep::torch_glue::all_gather_cuda);
  m.impl("reduce_scatter", &uniep::torch_glue::reduce_scatter_cuda);
  m.impl("all_to_all_ulysses", &uniep::torch_glue::all_to_all_ulysses_cuda);
}
