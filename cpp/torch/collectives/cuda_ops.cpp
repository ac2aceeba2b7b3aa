// CUDA implementations of the collective ops (schemas in cpu_ops.cpp) over the NVSHMEM
// collectives runtime: argument checks, output allocation, and the GEMM of a row range (at::mm,
// or UniEP's sm90 GEMM: see gemm.hpp) on the caller's stream, which the runtime's schedule
// interleaves with its copies.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/gemm/gemm.hpp"
#include "torch/collectives/gemm.hpp"
#include "torch/collectives/registry.hpp"
#include "torch/common/process_group.hpp"
#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "uniep/cuda/collectives.hpp"
#include "uniep/cuda/grouped_gemm.hpp"
#include "uniep/cuda/part_gemm.hpp"

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

// The runtime was created for this group's ranks (init_cuda, with its parent for a sub-group),
// so its group size is the group's.
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

std::mutex& coll_gemm_mutex() {
  static auto* m = new std::mutex;
  return *m;
}

CollGemm& coll_gemm_setting() {
  static auto* g = new CollGemm;
  return *g;
}

}  // namespace

const char* coll_gemm_backend_name(CollGemmBackend backend) {
  switch (backend) {
    case CollGemmBackend::kCublas:
      return "cublas";
    case CollGemmBackend::kCutlass:
      return "cutlass";
    case CollGemmBackend::kGated:
      return "gated";
  }
  return "?";
}

void set_coll_gemm(const std::string& backend, int64_t sm_carveout) {
  CollGemm g;
  if (backend == "cublas") {
    g.backend = CollGemmBackend::kCublas;
  } else if (backend == "cutlass") {
    g.backend = CollGemmBackend::kCutlass;
  } else if (backend == "gated") {
    g.backend = CollGemmBackend::kGated;
  } else {
    UNIEP_CHECK(false, "backend must be \"cublas\", \"cutlass\" or \"gated\", got \"", backend,
                "\"");
  }
  UNIEP_CHECK(sm_carveout >= 0, "sm_carveout must be >= 0, got ", sm_carveout);
  g.sm_carveout = sm_carveout;
  const std::lock_guard<std::mutex> lock(coll_gemm_mutex());
  coll_gemm_setting() = g;
}

CollGemm coll_gemm() {
  const std::lock_guard<std::mutex> lock(coll_gemm_mutex());
  return coll_gemm_setting();
}

namespace {

// The GEMM of a row range: out[rows] = a[rows] @ b (+ addend[rows]) on the current stream, which
// is the stream the runtime was handed; UniEP's sm90 GEMM where the call chose it.
struct MmContext {
  at::Tensor b;
  int64_t k = 0;
  at::TensorOptions options;
  bool sm90 = false;
  int device = 0;
  int sm_count = 0;
  cuda::GemmTuning tuning;  // the kernel's own choices
  at::Tensor workspace;
};

cuda::GemmOperands row_operands(const MmContext& c, const void* a_rows, const void* addend,
                                void* out_rows, int64_t rows) {
  cuda::GemmOperands op;
  op.a = a_rows;
  op.b = c.b.data_ptr();
  op.c = addend;
  op.d = out_rows;
  op.m = rows;
  op.n = c.b.size(1);
  op.k = c.k;
  op.lda = c.k;
  op.ldb = op.n;
  op.ldc = op.n;
  op.ldd = op.n;
  return op;
}

// The runtime reports a bad chunk count; until then it only sizes the GEMM's workspace.
int64_t chunks_or_one(int64_t chunks) {
  return chunks >= 1 ? chunks : 1;
}

// SMs of the GEMM's persistent grid: the device's but `sm_carveout`.
int gemm_sm_count(int device, int64_t sm_carveout) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  UNIEP_CHECK(sm_carveout >= 0 && sm_carveout < sms, "sm_carveout=", sm_carveout,
              " must leave the GEMM at least one of the ", sms, " SMs of this GPU");
  return sms - static_cast<int>(sm_carveout);
}

at::Tensor gemm_workspace(const cuda::GemmOperands& op, const cuda::GemmTuning& tuning,
                          int sm_count, const at::Tensor& like) {
  const size_t bytes = cuda::gemm_sm90_workspace_bytes(op, tuning, sm_count);
  if (bytes == 0) return {};
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

Status run_gemm(const cuda::GemmOperands& op, const cuda::GemmTuning& tuning, int device,
                int sm_count, const at::Tensor& workspace, cudaStream_t stream) {
  return cuda::gemm_sm90_bf16(
      op, tuning, device, sm_count, workspace.defined() ? workspace.data_ptr() : nullptr,
      workspace.defined() ? static_cast<size_t>(workspace.numel()) : 0, stream);
}

// Whether a call's chunks of `rows` rows run on the sm90 GEMM, and its grid and workspace.
MmContext mm_context(const at::Tensor& a, const at::Tensor& b, int64_t rows) {
  MmContext ctx{b, a.size(1), a.options()};
  const CollGemm choice = coll_gemm();
  if (choice.backend == CollGemmBackend::kCublas) return ctx;
  ctx.device = a.device().index();
  // Representative operands (the call's own pointers are checked again per chunk); where the
  // kernel cannot take them, cuBLAS does.
  const cuda::GemmOperands op = row_operands(ctx, a.data_ptr(), nullptr, a.data_ptr(), rows);
  if (a.scalar_type() != at::kBFloat16 || !cuda::gemm_sm90_device_ok(ctx.device) ||
      !cuda::gemm_sm90_supports(op).ok())
    return ctx;
  ctx.sm_count = gemm_sm_count(ctx.device, choice.sm_carveout);
  ctx.sm90 = true;
  ctx.workspace = gemm_workspace(op, ctx.tuning, ctx.sm_count, a);
  return ctx;
}

Status mm_rows(void* ctx, const void* a_rows, const void* addend, void* out_rows, int64_t rows,
               cudaStream_t stream) {
  auto* c = static_cast<MmContext*>(ctx);
  if (stream != at::cuda::getCurrentCUDAStream().stream())
    return {StatusCode::kInternal, "the GEMM callback runs on the current stream only"};
  if (c->sm90) {
    const cuda::GemmOperands op = row_operands(*c, a_rows, addend, out_rows, rows);
    const Status fits = cuda::gemm_sm90_supports(op);
    if (fits.ok()) return run_gemm(op, c->tuning, c->device, c->sm_count, c->workspace, stream);
  }
  try {
    at::Tensor a = at::from_blob(const_cast<void*>(a_rows), {rows, c->k}, c->options);
    at::Tensor out = at::from_blob(out_rows, {rows, c->b.size(1)}, c->options);
    if (addend != nullptr) {
      at::Tensor add = at::from_blob(const_cast<void*>(addend), {rows, c->b.size(1)}, c->options);
      at::addmm_out(out, add, a, c->b);
    } else {
      at::mm_out(out, a, c->b);
    }
  } catch (const std::exception& e) {
    return {StatusCode::kInternal, detail::str_cat("GEMM of a chunk failed: ", e.what())};
  }
  return Status::Ok();
}

// The one gated GEMM of an all-gather + GEMM (set_gemm("gated")): B, its device and grid, and a
// workspace for the call's W * chunks parts.
struct PartsContext {
  at::Tensor b;
  int device = 0;
  int sm_count = 0;    // the grid: the device's SMs but the carve-out
  int device_sms = 0;  // the device's
  at::Tensor workspace;
  int swizzle = 0;
  char raster = 0;
  int tile_n = 0;  // 0: part_gemm_tile_n's choice
};

PartsContext parts_context(const at::Tensor& b, int64_t count, int64_t sm_carveout) {
  PartsContext ctx;
  ctx.b = b;
  ctx.device = b.device().index();
  ctx.sm_count = gemm_sm_count(ctx.device, sm_carveout);
  ctx.device_sms = gemm_sm_count(ctx.device, 0);
  const size_t bytes = cuda::part_gemm_workspace_bytes(count, ctx.sm_count);
  ctx.workspace = at::empty({static_cast<int64_t>(bytes)}, b.options().dtype(at::kByte));
  return ctx;
}

// The part GEMM pads every part to whole clusters of its tiles (kGatedTileM rows, two along M):
// where that adds more than a quarter of a part's rows, the chunks' GEMMs run instead (parts of
// 64 rows, padded to 256, compute four times the rows they hold).
bool parts_fill_tiles(int64_t rows) {
  constexpr int64_t kCluster = 2 * cuda::kGatedTileM;
  const int64_t padded = (rows + kCluster - 1) / kCluster * kCluster;
  return rows > 0 && 4 * padded <= 5 * rows;
}

// Whether a collective + GEMM of `chunks` chunks per rank (`rows` rows each side), a [.., K] @
// b [K, N] into out, runs as one part GEMM: set_gemm("gated") chose it, and the operands (what
// part_gemm_supports takes, bf16 on Hopper) and the chunks (whole tile clusters) fit it; then
// *ctx gets its workspace for the call's W * chunks parts. Else the chunk GEMMs run. A bad chunk
// count is the runtime's to report: it sizes no workspace here.
bool use_parts(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, int64_t rows,
               int64_t chunks, int64_t W, PartsContext* ctx) {
  const CollGemm choice = coll_gemm();
  if (choice.backend != CollGemmBackend::kGated || chunks < 1 || chunks > coll::kMaxChunks ||
      rows % chunks != 0 || !parts_fill_tiles(rows / chunks))
    return false;
  if (a.scalar_type() != at::kBFloat16 || !cuda::grouped_gemm_device_ok(a.device().index()))
    return false;
  const cuda::GemmPart first{a.data_ptr(), out.data_ptr(), nullptr};
  cuda::PartGemmProblem p;
  p.parts = &first;
  p.count = 1;
  p.rows = rows / chunks;
  p.k = b.size(0);
  p.n = b.size(1);
  p.b = b.data_ptr();
  if (!cuda::part_gemm_supports(p).ok()) return false;
  *ctx = parts_context(b, W * chunks, choice.sm_carveout);
  return true;
}

cuda::PartGemmProblem parts_problem(const PartsContext& c, const cuda::GemmPart* parts,
                                    int64_t count, int64_t rows) {
  cuda::PartGemmProblem p;
  p.swizzle = c.swizzle;
  p.raster = c.raster;
  p.tile_n = c.tile_n;
  p.parts = parts;
  p.count = count;
  p.rows = rows;
  p.k = c.b.size(0);
  p.n = c.b.size(1);
  p.b = c.b.data_ptr();
  return p;
}

Status run_parts(void* ctx, const cuda::GemmPart* parts, int64_t count, int64_t rows,
                 const cuda::PartGate& gate, int spare_sms, uint32_t* done, cudaStream_t stream) {
  auto* c = static_cast<PartsContext*>(ctx);
  // A smaller grid needs no more workspace than the one it was sized for.
  const int sms = std::max(1, std::min(c->sm_count, c->device_sms - spare_sms));
  cuda::PartGemmProblem p = parts_problem(*c, parts, count, rows);
  p.done = done;
  return cuda::part_gemm_bf16(p, gate, c->device, sms, c->workspace.data_ptr(),
                              static_cast<size_t>(c->workspace.numel()), stream);
}

std::tuple<at::Tensor, at::Tensor> all_gather_matmul_cuda(const at::Tensor& a, const at::Tensor& b,
                                                          c10::string_view group_name,
                                                          int64_t chunks, c10::string_view order) {
  return translate_errors_on(group_name, [&] {
    check_matmul_operands(a, b, "[M/W, K]", "[K, N]", Executor::kCuda);
    check_direct(order);
    const OpScope scope(a, group_name);
    const int64_t W = scope.rt.config().group_size();
    at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor ag = at::empty({W * a.size(0), a.size(1)}, a.options());
    at::Tensor mm = at::empty({W * a.size(0), b.size(1)}, a.options());
    MmContext ctx = mm_context(ac, bc, a.size(0) / chunks_or_one(chunks));
    PartsContext parts;
    const bool gated = use_parts(ac, bc, mm, a.size(0), chunks, W, &parts);
    coll::AllGatherCall c;
    c.a = ac.data_ptr();
    c.gathered = ag.data_ptr();
    c.rows_per_rank = a.size(0);
    c.row_bytes = a.size(1) * a.element_size();
    c.chunks = chunks;
    c.gemm = {&mm_rows, &ctx, false};
    if (gated) c.parts_gemm = {&run_parts, &parts};
    c.out = mm.data_ptr();
    c.out_row_bytes = b.size(1) * a.element_size();
    ok_or_throw(scope.rt.all_gather(c, at::cuda::getCurrentCUDAStream().stream()));
    return std::make_tuple(ag, mm);
  });
}

at::Tensor matmul_reduce_scatter_cuda(const at::Tensor& a, const at::Tensor& b,
                                      c10::string_view group_name, int64_t chunks,
                                      c10::string_view order) {
  return translate_errors_on(group_name, [&] {
    check_matmul_operands(a, b, "[M, K_local]", "[K_local, N]", Executor::kCuda);
    check_direct(order);
    const OpScope scope(a, group_name);
    const int64_t rows = matmul_reduce_scatter_rows(a, scope.rt.config().group_size());
    at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor scratch = at::empty({a.size(0), b.size(1)}, a.options());
    at::Tensor out = at::empty({rows, b.size(1)}, a.options());
    MmContext ctx = mm_context(ac, bc, rows / chunks_or_one(chunks));
    PartsContext parts;
    const bool gated =
        use_parts(ac, bc, scratch, rows, chunks, scope.rt.config().group_size(), &parts);
    coll::ReduceScatterCall c;
    c.dtype = to_dtype(a, "a");
    c.a = ac.data_ptr();
    c.a_row_bytes = a.size(1) * a.element_size();
    c.scratch = scratch.data_ptr();
    c.out = out.data_ptr();
    c.rows_per_rank = rows;
    c.n = b.size(1);
    c.chunks = chunks;
    // gated: no fold in the chunk GEMMs' epilogue either, so that every chunking gives the
    // fixed-order sum of the same partials (sm90_gemm's bits are the part GEMM's).
    c.gemm = {&mm_rows, &ctx, ctx.sm90 && coll_gemm().backend != CollGemmBackend::kGated};
    if (gated) c.parts_gemm = {&run_parts, &parts};
    ok_or_throw(scope.rt.reduce_scatter(c, at::cuda::getCurrentCUDAStream().stream()));
    return out;
  });
}

// The tile order of sm90_gemm and part_gemm: "auto", "m" or "n".
void check_raster(c10::string_view raster) {
  UNIEP_CHECK(raster == "auto" || raster == "m" || raster == "n",
              "raster must be \"auto\", \"m\" or \"n\", got \"", std::string(raster), "\"");
}

at::Tensor sm90_gemm_cuda(const at::Tensor& a, const at::Tensor& b,
                          const std::optional<at::Tensor>& c, int64_t sm_carveout, int64_t tile_n,
                          int64_t swizzle, c10::string_view raster) {
  return translate_errors([&] {
    cuda::GemmTuning tuning;
    tuning.tile_n = static_cast<int>(tile_n);
    tuning.swizzle = static_cast<int>(swizzle);
    check_raster(raster);
    tuning.raster = raster == "m"   ? cuda::GemmRaster::kAlongM
                    : raster == "n" ? cuda::GemmRaster::kAlongN
                                    : cuda::GemmRaster::kAuto;
    ok_or_throw(tuning.validate());
    check_matmul_operands(a, b, "[M, K]", "[K, N]", Executor::kCuda);
    UNIEP_CHECK(a.scalar_type() == at::kBFloat16, "a must be bfloat16 (the sm90 GEMM), got ",
                c10::toString(a.scalar_type()));
    if (c.has_value()) {
      UNIEP_CHECK(c->scalar_type() == a.scalar_type() && c->device() == a.device(),
                  "c must be bfloat16 on a's device ", a.device(), ", got ",
                  c10::toString(c->scalar_type()), " on ", c->device());
      UNIEP_CHECK(c->dim() == 2 && c->size(0) == a.size(0) && c->size(1) == b.size(1),
                  "c must be [M, N] = [", a.size(0), ", ", b.size(1), "], got ", c->sizes());
    }
    const c10::cuda::CUDAGuard guard(a.device());
    const int device = a.device().index();
    UNIEP_CHECK_CODE(cuda::gemm_sm90_device_ok(device), StatusCode::kUnsupported,
                     "the sm90 GEMM needs a compute capability 9.0 GPU");
    const int sm_count = gemm_sm_count(device, sm_carveout);
    at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor cc = c.has_value() ? c->contiguous() : at::Tensor();
    at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
    MmContext ctx{bc, a.size(1), a.options()};
    const cuda::GemmOperands op = row_operands(
        ctx, ac.data_ptr(), cc.defined() ? cc.data_ptr() : nullptr, out.data_ptr(), a.size(0));
    // run_gemm names what the kernel lacks (gemm_sm90_supports); the workspace of operands it
    // refuses is empty.
    ok_or_throw(run_gemm(op, tuning, device, sm_count, gemm_workspace(op, tuning, sm_count, a),
                         at::cuda::getCurrentCUDAStream().stream()));
    return out;
  });
}

at::Tensor part_gemm_cuda(const at::Tensor& a, const at::Tensor& b, int64_t parts,
                          const std::optional<at::Tensor>& ready, int64_t epoch, double timeout_s,
                          int64_t sm_carveout, int64_t swizzle, c10::string_view raster,
                          int64_t tile_n) {
  return translate_errors([&] {
    check_matmul_operands(a, b, "[M, K]", "[K, N]", Executor::kCuda);
    check_raster(raster);
    UNIEP_CHECK(tile_n == 0 || tile_n == 128 || tile_n == cuda::kGatedTileN,
                "tile_n must be 0 (auto), 128 or ", cuda::kGatedTileN, ", got ", tile_n);
    UNIEP_CHECK(a.scalar_type() == at::kBFloat16, "a must be bfloat16 (the part GEMM), got ",
                c10::toString(a.scalar_type()));
    UNIEP_CHECK(parts >= 1 && a.size(0) % parts == 0, "parts (", parts,
                ") must be >= 1 and divide the rows of a (", a.size(0), ")");
    UNIEP_CHECK(epoch >= 0, "epoch must be >= 0, got ", epoch);
    UNIEP_CHECK(timeout_s > 0, "timeout_s must be > 0, got ", timeout_s);
    if (ready.has_value()) {
      UNIEP_CHECK(ready->scalar_type() == at::kLong && ready->dim() == 1 &&
                      ready->size(0) == parts && ready->is_contiguous(),
                  "ready must be a contiguous int64 tensor [parts] = [", parts, "], got ",
                  c10::toString(ready->scalar_type()), " of shape ", ready->sizes());
      UNIEP_CHECK(ready->device() == a.device(), "ready must be on a's device ", a.device(),
                  ", got ", ready->device());
    }
    const c10::cuda::CUDAGuard guard(a.device());
    const int device = a.device().index();
    UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                     "the part GEMM needs a compute capability 9.0 GPU");
    at::Tensor ac = a.contiguous(), bc = b.contiguous();
    at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
    const int64_t rows = a.size(0) / parts;
    if (rows == 0 || b.size(1) == 0) return out;
    PartsContext ctx = parts_context(bc, parts, sm_carveout);
    ctx.swizzle = static_cast<int>(swizzle);
    ctx.raster = raster == "auto" ? 0 : raster[0];
    ctx.tile_n = static_cast<int>(tile_n);
    at::Tensor record;
    cuda::PartGate gate;
    if (ready.has_value()) {
      record = at::zeros({static_cast<int64_t>(sizeof(cuda::GateTimeout))},
                         a.options().dtype(at::kByte));
      gate.epoch = static_cast<uint64_t>(epoch);
      gate.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
      gate.timeout = reinterpret_cast<cuda::GateTimeout*>(record.data_ptr());
    }
    std::vector<cuda::GemmPart> table(static_cast<size_t>(parts));
    const auto* a_rows = static_cast<const uint8_t*>(ac.data_ptr());
    auto* out_rows = static_cast<uint8_t*>(out.data_ptr());
    for (int64_t i = 0; i < parts; ++i) {
      table[i].a = a_rows + i * rows * a.size(1) * a.element_size();
      table[i].out = out_rows + i * rows * b.size(1) * a.element_size();
      if (ready.has_value())
        table[i].ready = reinterpret_cast<const uint64_t*>(ready->data_ptr<int64_t>()) + i;
    }
    ok_or_throw(run_parts(&ctx, table.data(), parts, rows, gate, 0, nullptr,
                          at::cuda::getCurrentCUDAStream().stream()));
    if (record.defined()) {
      cuda::GateTimeout t;
      const at::Tensor host = record.cpu();  // synchronizes with the GEMM
      std::memcpy(&t, host.data_ptr(), sizeof(t));
      UNIEP_CHECK_CODE(t.flag == 0, StatusCode::kTimeout, "part_gemm: the tiles of part ", t.expert,
                       " waited ", timeout_s, " s for ready[", t.expert, "] to reach epoch ", epoch,
                       " (it held ", t.have, ")");
    }
    return out;
  });
}

at::Tensor all_gather_cuda(const at::Tensor& x, c10::string_view group_name, int64_t chunks,
                           c10::string_view order) {
  return translate_errors_on(group_name, [&] {
    check_rows_input(x, Executor::kCuda);
    check_direct(order);
    const OpScope scope(x, group_name);
    at::Tensor xc = x.contiguous();
    at::Tensor out = empty_with_rows(x, scope.rt.config().group_size() * x.size(0));
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
  return translate_errors_on(group_name, [&] {
    check_rows_input(x, Executor::kCuda);
    check_direct(order);
    const OpScope scope(x, group_name);
    const int64_t rows = reduce_scatter_rows(x, scope.rt.config().group_size());
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
  return translate_errors_on(group_name, [&] {
    check_ulysses_input(x, Executor::kCuda);
    const OpScope scope(x, group_name);
    const int64_t W = scope.rt.config().group_size();
    const UlyssesDims dims = ulysses_dims(x, scatter_dim, gather_dim);
    const at::Tensor xc = x.contiguous();
    const UlyssesLayout layout = ulysses_tensor_layout(xc, dims, W);
    at::Tensor out = at::empty(layout.out_shape, x.options());
    // The blocks go from x's slices straight into the peers' slots and from the slots straight
    // into the output's slices (2-D copies): no pack or unpack copy around the exchange.
    coll::AllToAllCall c;
    c.send = xc.data_ptr();
    c.recv = out.data_ptr();
    c.block_bytes = layout.block_bytes;
    c.send_blocks = layout.send;
    c.recv_blocks = layout.recv;
    ok_or_throw(scope.rt.all_to_all(c, at::cuda::getCurrentCUDAStream().stream()));
    return out;
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
  m.impl("sm90_gemm", &uniep::torch_glue::sm90_gemm_cuda);
  m.impl("part_gemm", &uniep::torch_glue::part_gemm_cuda);
}
