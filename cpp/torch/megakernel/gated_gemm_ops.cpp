// CUDA implementations of uniep::gate_tile_base and uniep::grouped_mm_gated (schemas in
// registration.cpp): the tile gates of the MegaKernel (include/uniep/cuda/tile_gate.hpp) on torch
// tensors, so that the gate can be tested and timed on its own. No host sync: a gated GEMM may
// wait for work that is enqueued after it returns.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <optional>

#include "torch/common/runtime_registry.hpp"
#include "torch/common/validate.hpp"
#include "torch/gemm/grouped.hpp"
#include "uniep/cuda/tile_gate.hpp"

namespace uniep::torch_glue {
namespace {

void check_int_vector(const at::Tensor& t, const char* name, at::ScalarType dtype,
                      const at::Tensor& like) {
  UNIEP_CHECK(t.dim() == 1, name, " must be 1-D, got shape ", t.sizes());
  UNIEP_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  UNIEP_CHECK(t.device() == like.device(), name, " must be on ", like.device(), ", got ",
              t.device());
  UNIEP_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

at::Tensor gate_tile_base_cuda(const at::Tensor& offs, int64_t rows, int64_t tile_m) {
  return translate_errors([&] {
    UNIEP_CHECK(offs.device().is_cuda(), "offs must be a CUDA tensor, got ", offs.device());
    check_int_vector(offs, "offs", at::kInt, offs);
    UNIEP_CHECK(offs.size(0) >= 1, "offs must have at least one expert");
    UNIEP_CHECK(tile_m >= 1 && tile_m <= (1 << 20), "tile_m must be in [1, 2^20], got ", tile_m);
    const c10::cuda::CUDAGuard guard(offs.device());
    at::Tensor base = at::empty({offs.size(0) + 1}, offs.options());
    ok_or_throw(cuda::gate_tile_base(offs.data_ptr<int32_t>(), offs.size(0), rows,
                                     static_cast<int>(tile_m), base.data_ptr<int32_t>(),
                                     at::cuda::getCurrentCUDAStream().stream()));
    return base;
  });
}

// Writes out; returns timeout [5] int32, GateTimeout (flag, expert, m_tile, have, need) written by
// the device: read it after the stream is done (uniep.moe.tile_gates.check_gate_timeout). `out` is
// the caller's so that a second gated GEMM can be enqueued on it before this one runs.
at::Tensor grouped_mm_gated_cuda(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs,
                                 const at::Tensor& counters, const at::Tensor& tile_base,
                                 int64_t per_row, int64_t per_tile, double timeout_s, bool swiglu,
                                 const std::optional<at::Tensor>& done, int64_t sm_count,
                                 const at::Tensor& out, bool w1_as_stored) {
  return translate_errors([&] {
    check_grouped_mm_args(x, w, offs);
    UNIEP_CHECK(w.is_contiguous(), "w must be contiguous (row-major [E, K, N]), got strides ",
                w.strides());
    check_int_vector(counters, "counters", at::kInt, x);
    check_int_vector(tile_base, "tile_base", at::kInt, x);
    UNIEP_CHECK(tile_base.size(0) == w.size(0) + 1, "tile_base must have E + 1 = ", w.size(0) + 1,
                " entries (gate_tile_base), got ", tile_base.size(0));
    UNIEP_CHECK(per_row >= 0 && per_tile >= 0 && per_row <= (1 << 20) && per_tile <= (1 << 30),
                "per_row and per_tile must be small non-negative counts, got ", per_row, " and ",
                per_tile);
    UNIEP_CHECK(timeout_s >= 0 && timeout_s <= 3600, "timeout_s must be in [0, 3600], got ",
                timeout_s);
    UNIEP_CHECK(!w1_as_stored || swiglu,
                "w1_as_stored describes the SwiGLU GEMM's w1: pass swiglu=True with it");
    if (swiglu && !w1_as_stored) check_swiglu_width(w);
    if (w1_as_stored) check_w1_as_stored(w.size(2) / 2);
    UNIEP_CHECK(!done.has_value() || swiglu,
                "done is the SwiGLU epilogue's signal: pass swiglu=True with it");
    if (done.has_value()) check_int_vector(*done, "done", at::kInt, x);
    const int device = x.device().index();
    int device_sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, device));
    UNIEP_CHECK(sm_count >= 1 && sm_count <= device_sms, "sm_count must be in [1, ", device_sms,
                "], got ", sm_count);
    UNIEP_CHECK_CODE(cuda::grouped_gemm_device_ok(device), StatusCode::kUnsupported,
                     "the grouped GEMM needs a compute capability 9.0 GPU (built for sm_90a)");

    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), n = w.size(2), out_n = swiglu ? n / 2 : n;
    UNIEP_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == out_n &&
                    out.scalar_type() == at::kBFloat16 && out.device() == x.device() &&
                    out.is_contiguous(),
                "out must be contiguous bfloat16 [", rows, ", ", out_n, "] on ", x.device(),
                ", got ", out.scalar_type(), " ", out.sizes(), " on ", out.device());
    at::Tensor timeout = at::zeros({5}, x.options().dtype(at::kInt));
    if (rows == 0) return timeout;
    const cuda::GroupedGemmProblem p =
        forward_problem(x, w, offs, out,
                        w1_as_stored ? cuda::GroupedGemmEpilogue::kSwiGluPlain
                        : swiglu     ? cuda::GroupedGemmEpilogue::kSwiGlu
                                     : cuda::GroupedGemmEpilogue::kStore);
    cuda::TileGate gate;
    gate.counters = reinterpret_cast<const uint32_t*>(counters.data_ptr<int32_t>());
    gate.num_counters = counters.size(0);
    gate.tile_base = tile_base.data_ptr<int32_t>();
    gate.per_row = static_cast<uint32_t>(per_row);
    gate.per_tile = static_cast<uint32_t>(per_tile);
    gate.timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
    gate.timeout = reinterpret_cast<cuda::GateTimeout*>(timeout.data_ptr<int32_t>());
    cuda::GatedSignal signal;
    if (done.has_value()) {
      signal.done = reinterpret_cast<uint32_t*>(done->data_ptr<int32_t>());
      signal.done_base = tile_base.data_ptr<int32_t>();
      signal.num_done = done->size(0);
    }
    const size_t bytes =
        cuda::grouped_gemm_gated_workspace_bytes(p.num_experts, static_cast<int>(sm_count));
    at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
    ok_or_throw(cuda::grouped_gemm_gated_bf16(p, gate, signal, device, static_cast<int>(sm_count),
                                              workspace.data_ptr(), bytes,
                                              at::cuda::getCurrentCUDAStream(device).stream()));
    return timeout;
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CUDA, m) {
  m.impl("gate_tile_base", &uniep::torch_glue::gate_tile_base_cuda);
  m.impl("grouped_mm_gated", &uniep::torch_glue::grouped_mm_gated_cuda);
}
