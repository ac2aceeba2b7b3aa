#include "torch/gemm/fp8_weights.hpp"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <vector>

#include "torch/common/validate.hpp"
#include "uniep/fp8_weights.hpp"
#include "uniep/status.hpp"

namespace uniep::torch_glue {

namespace {
constexpr int64_t kBlock = kFp8WeightBlock;
constexpr double kE4m3Max = 448.0;

at::Tensor long_index(const std::vector<int64_t>& v, const at::Tensor& like) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(like.device());
}
}  // namespace

std::pair<at::Tensor, at::Tensor> quantize_expert_weights(const at::Tensor& w) {
  UNIEP_CHECK(w.dim() == 3 && w.size(1) % kBlock == 0 && w.size(2) % kBlock == 0,
              "w must be [E, K, N] with K and N multiples of 128, got shape ", w.sizes());
  UNIEP_CHECK(at::isFloatingType(w.scalar_type()), "w must be a floating-point tensor, got ",
              w.scalar_type());
  const int64_t e = w.size(0), k = w.size(1), n = w.size(2), kb = k / kBlock, nb = n / kBlock;
  const c10::OptionalDeviceGuard guard(w.device());
  at::Tensor q = at::empty({e, n, k}, w.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scales = at::empty({e, kb, nb}, w.options().dtype(at::kFloat));
  // One expert at a time: fp32 temporaries of all of w (a DeepSeek-V3 rank's w1 is 1.9 GB in
  // bf16) would take several times its memory.
  for (int64_t i = 0; i < e; ++i) {
    const at::Tensor blocks = w[i].to(at::kFloat).reshape({kb, kBlock, nb, kBlock});
    const at::Tensor amax = blocks.abs().amax({1, 3});
    const at::Tensor some = amax > 0;
    const at::Tensor ones = at::ones_like(amax);
    const at::Tensor scale = at::where(some, amax / kE4m3Max, ones);
    const at::Tensor inv = at::where(some, amax.reciprocal() * kE4m3Max, ones);
    const at::Tensor qi = (blocks * inv.view({kb, 1, nb, 1})).clamp(-kE4m3Max, kE4m3Max);
    q[i].copy_(qi.to(at::kFloat8_e4m3fn).reshape({k, n}).t());
    scales[i].copy_(scale);
  }
  return {q, scales};
}

namespace {

// w1's rows q [E, 2I, K] e4m3 and their scales [E, K / 128, 2I / scale_rows] (128: as quantized,
// 64: packed) on one device; the messages name q `name`. Returns 2I.
int64_t check_gate_up(const at::Tensor& q, const at::Tensor& s, int64_t scale_rows,
                      const char* name) {
  UNIEP_CHECK(q.dim() == 3 && s.dim() == 3, name,
              " must be [E, 2I, K] with scales [E, K / 128, 2I / ", scale_rows, "], got shapes ",
              q.sizes(), " and ", s.sizes());
  const int64_t e = q.size(0), n = q.size(1), k = q.size(2);
  UNIEP_CHECK(n % kBlock == 0 && k % kBlock == 0, name,
              " [E, 2I, K] needs 2I and K multiples of 128 (one scale per 128 x 128 block), got "
              "shape ",
              q.sizes());
  UNIEP_CHECK(s.size(0) == e && s.size(1) == k / kBlock && s.size(2) == n / scale_rows,
              "the scales of ", name, " ", q.sizes(), " must be [E, K / 128, 2I / ", scale_rows,
              "] = [", e, ", ", k / kBlock, ", ", n / scale_rows, "], got ", s.sizes());
  UNIEP_CHECK(q.scalar_type() == at::kFloat8_e4m3fn, name, " must be float8_e4m3fn, got ",
              q.scalar_type());
  UNIEP_CHECK(s.scalar_type() == at::kFloat, "the scales of ", name, " must be float32, got ",
              s.scalar_type());
  UNIEP_CHECK(s.device() == q.device(), "the scales of ", name, " must be on its device ",
              q.device(), ", got ", s.device());
  return n;
}

}  // namespace

std::pair<at::Tensor, at::Tensor> pack_gate_up_fp8(const at::Tensor& q1, const at::Tensor& s1) {
  const int64_t n = check_gate_up(q1, s1, kBlock, "q1"), ffn = n / 2;
  const c10::OptionalDeviceGuard guard(q1.device());
  std::vector<int64_t> rows(static_cast<size_t>(n)),
      blocks(static_cast<size_t>(n / kGateUpPackRows));
  for (int64_t p = 0; p < n; ++p) rows[static_cast<size_t>(p)] = gate_up_source_row(p, ffn);
  for (int64_t g = 0; g < n / kGateUpPackRows; ++g)
    blocks[static_cast<size_t>(g)] = gate_up_source_block(g, ffn);
  return {q1.index_select(1, long_index(rows, q1)).contiguous(),
          s1.index_select(2, long_index(blocks, s1)).contiguous()};
}

std::pair<at::Tensor, at::Tensor> unpack_gate_up_fp8(const at::Tensor& q, const at::Tensor& s) {
  const int64_t n = check_gate_up(q, s, kGateUpPackRows, "q_packed"), ffn = n / 2;
  const c10::OptionalDeviceGuard guard(q.device());
  // Row r of w1 is packed row p where gate_up_source_row(p) = r; block b's scale is that of
  // any packed group it went to (both of its 64-row halves carry it): the first.
  std::vector<int64_t> rows(static_cast<size_t>(n)), groups(static_cast<size_t>(n / kBlock), -1);
  for (int64_t p = 0; p < n; ++p) rows[static_cast<size_t>(gate_up_source_row(p, ffn))] = p;
  for (int64_t g = n / kGateUpPackRows - 1; g >= 0; --g)
    groups[static_cast<size_t>(gate_up_source_block(g, ffn))] = g;
  return {q.index_select(1, long_index(rows, q)).contiguous(),
          s.index_select(2, long_index(groups, s)).contiguous()};
}

namespace {

std::tuple<at::Tensor, at::Tensor> unpack_gate_up_fp8_op(const at::Tensor& q, const at::Tensor& s) {
  return translate_errors([&] {
    auto [w, ws] = unpack_gate_up_fp8(q, s);
    return std::make_tuple(w, ws);
  });
}

std::tuple<at::Tensor, at::Tensor> quantize_expert_weights_op(const at::Tensor& w) {
  return translate_errors([&] {
    auto [q, s] = quantize_expert_weights(w);
    return std::make_tuple(q, s);
  });
}

std::tuple<at::Tensor, at::Tensor> pack_gate_up_fp8_op(const at::Tensor& q1, const at::Tensor& s1) {
  return translate_errors([&] {
    auto [q, s] = pack_gate_up_fp8(q1, s1);
    return std::make_tuple(q, s);
  });
}

}  // namespace
}  // namespace uniep::torch_glue

// Composed of aten ops on whatever device the weights are: one kernel for every backend.
TORCH_LIBRARY_IMPL(uniep, CompositeExplicitAutograd, m) {
  m.impl("quantize_expert_weights", &uniep::torch_glue::quantize_expert_weights_op);
  m.impl("pack_gate_up_fp8", &uniep::torch_glue::pack_gate_up_fp8_op);
  m.impl("unpack_gate_up_fp8", &uniep::torch_glue::unpack_gate_up_fp8_op);
}
