// CPU implementations of uniep::sender_rows and uniep::send_rows (schemas in registration.cpp):
// the reference the CUDA kernels (cpp/cuda/megakernel/send_rows.cu) are tested against. Both
// record a failing entry in the error word as the device does, so the two executors answer a
// bad call alike. Also keep_first_errors (the deferred checks' sticky words).
#include "torch/megakernel/send_rows_ops.hpp"

#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "torch/common/validate.hpp"
#include "uniep/plan.hpp"
#include "uniep/send_rows_error.hpp"
#include "uniep/shape.hpp"

namespace uniep::torch_glue {
namespace {

void check_int64_matrix(const at::Tensor& t, const char* name) {
  UNIEP_CHECK(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  UNIEP_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  UNIEP_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name) {
  UNIEP_CHECK(t.device() == like.device(), name, " must be on ", like_name, "'s device ",
              like.device(), ", got ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sender_rows_cpu(
    const at::Tensor& topk_idx, const at::Tensor& expert_counts, int64_t rank, int64_t tile_m) {
  return translate_errors([&] {
    check_sender_rows_args(topk_idx, expert_counts, rank, tile_m);
    UNIEP_CHECK(topk_idx.device().is_cpu(), "topk_idx must be a CPU tensor here, got ",
                topk_idx.device());
    const int64_t T = topk_idx.size(0), K = topk_idx.size(1);
    const int64_t W = expert_counts.size(0), E = expert_counts.size(1);
    MoeShape shape;
    shape.tokens = T;
    shape.top_k = K;
    shape.num_experts = E;
    shape.world_size = W;
    shape.rank = rank;
    shape.hidden = shape.ffn_hidden = 1;
    const SenderRows plan = plan_sender_rows(topk_idx.data_ptr<int64_t>(),
                                             expert_counts.data_ptr<int64_t>(), shape, tile_m);
    at::Tensor error = at::full({1}, static_cast<int64_t>(plan.error), topk_idx.options());
    auto out = [&](const std::vector<int64_t>& v) {
      at::Tensor t = at::empty({T, K}, topk_idx.options());
      std::memcpy(t.data_ptr<int64_t>(), v.data(), sizeof(int64_t) * v.size());
      return t;
    };
    return std::make_tuple(out(plan.dest_rank), out(plan.gemm_row), out(plan.counter), error);
  });
}

at::Tensor send_order_cpu(const at::Tensor& topk_idx, const at::Tensor& expert_counts,
                          int64_t rank) {
  return translate_errors([&] {
    check_sender_rows_args(topk_idx, expert_counts, rank, 1);
    UNIEP_CHECK(topk_idx.device().is_cpu(), "topk_idx must be a CPU tensor here, got ",
                topk_idx.device());
    MoeShape shape;
    shape.tokens = topk_idx.size(0);
    shape.top_k = topk_idx.size(1);
    shape.num_experts = expert_counts.size(1);
    shape.world_size = expert_counts.size(0);
    shape.rank = rank;
    shape.hidden = shape.ffn_hidden = 1;
    const SenderRows plan =
        plan_sender_rows(topk_idx.data_ptr<int64_t>(), expert_counts.data_ptr<int64_t>(), shape, 1);
    at::Tensor order = at::empty({shape.tokens * shape.top_k}, topk_idx.options());
    std::memcpy(order.data_ptr<int64_t>(), plan.send_order.data(),
                sizeof(int64_t) * plan.send_order.size());
    return order;
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> expert_tiles_cpu(const at::Tensor& topk_idx,
                                                                int64_t num_experts,
                                                                int64_t tile_m) {
  return translate_errors([&] {
    check_expert_tiles_args(topk_idx, num_experts, tile_m);
    UNIEP_CHECK(topk_idx.device().is_cpu(), "topk_idx must be a CPU tensor here, got ",
                topk_idx.device());
    const ExpertTiles plan =
        expert_tiles(topk_idx.data_ptr<int64_t>(), topk_idx.numel(), num_experts, tile_m);
    auto [counts, offs, base] = empty_expert_tiles(topk_idx, num_experts);
    std::copy(plan.counts.begin(), plan.counts.end(), counts.data_ptr<int64_t>());
    std::copy(plan.offs.begin(), plan.offs.end(), offs.data_ptr<int32_t>());
    std::copy(plan.tile_base.begin(), plan.tile_base.end(), base.data_ptr<int32_t>());
    return std::make_tuple(counts, offs, base);
  });
}

LocalPlanTensors local_plan_cpu(const at::Tensor& topk_idx, int64_t num_experts, int64_t tile_m) {
  auto [counts, offs, base] = expert_tiles_cpu(topk_idx, num_experts, tile_m);
  auto [dest, row, counter, error] =
      sender_rows_cpu(topk_idx, counts.view({1, num_experts}), 0, tile_m);
  return std::make_tuple(counts, offs, base, dest, row, counter, error);
}

// The world-1 form: the only destination is this rank's own rows and counters.
at::Tensor send_rows_cpu(const at::Tensor& x, const at::Tensor& dest_rank,
                         const at::Tensor& gemm_row, const at::Tensor& counter,
                         const at::Tensor& rows, const at::Tensor& counters, int64_t sm_count) {
  return translate_errors([&] {
    check_send_rows_args(x, dest_rank, gemm_row, counter, rows, counters);
    UNIEP_CHECK(x.device().is_cpu(), "x must be a CPU tensor here, got ", x.device());
    UNIEP_CHECK(sm_count >= 1, "sm_count must be >= 1, got ", sm_count);
    const int64_t T = x.size(0), K = dest_rank.size(1);
    const int64_t row_bytes = x.size(1) * x.element_size();
    const int64_t stride = rows.size(1) * rows.element_size();
    const int64_t capacity = rows.size(0), num_counters = counters.size(0);
    const int64_t* dest = dest_rank.data_ptr<int64_t>();
    const int64_t* row = gemm_row.data_ptr<int64_t>();
    const int64_t* ctr = counter.data_ptr<int64_t>();
    const auto* src = static_cast<const uint8_t*>(x.data_ptr());
    auto* to = static_cast<uint8_t*>(rows.data_ptr());
    auto* c = counters.data_ptr<int32_t>();
    uint64_t word = 0;
    for (int64_t i = 0; i < T * K; ++i) {
      if (dest[i] < 0) continue;
      const uint64_t code = send_entry_check(dest[i], row[i], ctr[i], 1, capacity, num_counters);
      if (code != 0) {
        if (word == 0) word = send_error_word(code, i);
        continue;
      }
      std::memcpy(to + row[i] * stride, src + (i / K) * row_bytes, row_bytes);
      c[ctr[i]] += 1;
    }
    at::Tensor error = at::zeros({1}, x.options().dtype(at::kLong));
    error.data_ptr<int64_t>()[0] = static_cast<int64_t>(word);
    return error;
  });
}

std::tuple<at::Tensor, at::Tensor> combine_rows_cpu(const at::Tensor& y, const at::Tensor& gemm_row,
                                                    const at::Tensor& topk_weights, bool report) {
  return translate_errors([&] {
    check_combine_rows_args(y, gemm_row, topk_weights);
    UNIEP_CHECK(y.device().is_cpu(), "y must be a CPU tensor here, got ", y.device());
    const int64_t T = gemm_row.size(0), K = gemm_row.size(1), R = y.size(0);
    // Tensor ops, one per step: each product and each sum is rounded to fp32 on its own (no
    // fused multiply-add), as the device's __fmul_rn / __fadd_rn do.
    at::Tensor acc = at::zeros({T, y.size(1)}, y.options().dtype(at::kFloat));
    const at::Tensor w = topk_weights.to(at::kFloat);
    for (int64_t k = 0; k < K; ++k) {
      const at::Tensor r = gemm_row.select(1, k);
      const at::Tensor used = r.ge(0).logical_and(r.lt(R));
      const at::Tensor rows =
          y.index_select(0, r.clamp(0, std::max<int64_t>(R - 1, 0))).to(at::kFloat);
      const at::Tensor term = rows.mul(w.select(1, k).unsqueeze(1));
      acc = at::where(used.unsqueeze(1), acc.add(term), acc);
    }
    if (!report) return std::make_tuple(acc.to(at::kBFloat16), at::empty({0}, gemm_row.options()));
    // The first entry whose row lies past y, as the device's kernel records it.
    uint64_t word = 0;
    const int64_t* row = gemm_row.data_ptr<int64_t>();
    for (int64_t i = 0; i < T * K && word == 0; ++i)
      if (row[i] >= R) word = send_error_word(kSendRowOutOfRange, i);
    at::Tensor error = at::zeros({1}, gemm_row.options());
    error.data_ptr<int64_t>()[0] = static_cast<int64_t>(word);
    return std::make_tuple(acc.to(at::kBFloat16), error);
  });
}

}  // namespace

void check_combine_rows_args(const at::Tensor& y, const at::Tensor& gemm_row,
                             const at::Tensor& topk_weights) {
  UNIEP_CHECK(y.dim() == 2 && y.is_contiguous() && y.scalar_type() == at::kBFloat16,
              "y must be a contiguous bfloat16 [rows, hidden] tensor, got ", y.scalar_type(),
              " of shape ", y.sizes());
  UNIEP_CHECK(y.size(1) > 0 && y.size(1) % 8 == 0,
              "y's hidden size must be a positive multiple "
              "of 8, got ",
              y.size(1));
  check_int64_matrix(gemm_row, "gemm_row");
  UNIEP_CHECK(gemm_row.size(1) >= 1 && gemm_row.size(1) <= 32,
              "gemm_row must have 1 to 32 columns (top-k), got ", gemm_row.size(1));
  UNIEP_CHECK(topk_weights.sizes() == gemm_row.sizes() &&
                  topk_weights.scalar_type() == at::kFloat && topk_weights.is_contiguous(),
              "topk_weights must be contiguous float32 of gemm_row's shape ", gemm_row.sizes(),
              ", got ", topk_weights.scalar_type(), " of shape ", topk_weights.sizes());
  check_same_device(gemm_row, "gemm_row", y, "y");
  check_same_device(topk_weights, "topk_weights", y, "y");
  if (y.device().is_cpu() && y.size(0) == 0)
    UNIEP_CHECK(gemm_row.numel() == 0 || gemm_row.max().item<int64_t>() < 0,
                "y has no rows, so every gemm_row entry must be -1");
}

void check_sender_rows_args(const at::Tensor& topk_idx, const at::Tensor& expert_counts,
                            int64_t rank, int64_t tile_m) {
  check_int64_matrix(topk_idx, "topk_idx");
  check_int64_matrix(expert_counts, "expert_counts");
  check_same_device(expert_counts, "expert_counts", topk_idx, "topk_idx");
  const int64_t K = topk_idx.size(1), W = expert_counts.size(0), E = expert_counts.size(1);
  UNIEP_CHECK(K >= 1 && K <= 32, "topk_idx must have 1 to 32 columns (top-k), got ", K);
  UNIEP_CHECK(W >= 1 && E >= 1 && E % W == 0,
              "expert_counts must be [world_size, num_experts] with num_experts a positive "
              "multiple of world_size, got shape ",
              expert_counts.sizes());
  UNIEP_CHECK(rank >= 0 && rank < W, "rank must be in [0, world_size = ", W, "), got ", rank);
  UNIEP_CHECK(tile_m >= 1 && tile_m <= (1 << 20), "tile_m must be in [1, 2^20], got ", tile_m);
  if (expert_counts.device().is_cpu())
    UNIEP_CHECK(expert_counts.min().item<int64_t>() >= 0,
                "expert_counts must be non-negative row counts");
}

void check_expert_tiles_args(const at::Tensor& topk_idx, int64_t num_experts, int64_t tile_m) {
  check_int64_matrix(topk_idx, "topk_idx");
  UNIEP_CHECK(topk_idx.size(1) >= 1 && topk_idx.size(1) <= 32,
              "topk_idx must have 1 to 32 columns (top-k), got ", topk_idx.size(1));
  UNIEP_CHECK(topk_idx.numel() < (int64_t{1} << 31),
              "topk_idx must have fewer than 2^31 entries (offs are int32), got ",
              topk_idx.numel());
  UNIEP_CHECK(num_experts >= 1 && num_experts <= (int64_t{1} << 30),
              "num_experts must be in [1, 2^30], got ", num_experts);
  UNIEP_CHECK(tile_m >= 1 && tile_m <= (1 << 20), "tile_m must be in [1, 2^20], got ", tile_m);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_expert_tiles(const at::Tensor& topk_idx,
                                                                  int64_t num_experts) {
  at::Tensor counts = at::empty({num_experts}, topk_idx.options());
  at::Tensor offs = at::empty({num_experts}, topk_idx.options().dtype(at::kInt));
  return std::make_tuple(counts, offs, at::empty({num_experts + 1}, offs.options()));
}

void check_send_rows_args(const at::Tensor& x, const at::Tensor& dest_rank,
                          const at::Tensor& gemm_row, const at::Tensor& counter,
                          const at::Tensor& rows, const at::Tensor& counters) {
  UNIEP_CHECK(x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous [tokens, hidden] tensor, "
              "got shape ",
              x.sizes(), " and strides ", x.strides());
  const int64_t T = x.size(0), row_bytes = x.size(1) * x.element_size();
  UNIEP_CHECK(row_bytes > 0 && row_bytes % 16 == 0,
              "x's rows must be a positive multiple of 16 "
              "bytes, got ",
              row_bytes);
  check_int64_matrix(dest_rank, "dest_rank");
  UNIEP_CHECK(dest_rank.size(0) == T && dest_rank.size(1) >= 1 && dest_rank.size(1) <= 32,
              "dest_rank must be [tokens = ", T, ", top_k <= 32], got ", dest_rank.sizes());
  for (const auto& [t, name] :
       {std::pair<const at::Tensor&, const char*>{gemm_row, "gemm_row"}, {counter, "counter"}}) {
    check_int64_matrix(t, name);
    UNIEP_CHECK(t.sizes() == dest_rank.sizes(), name, " must have dest_rank's shape ",
                dest_rank.sizes(), ", got ", t.sizes());
  }
  UNIEP_CHECK(rows.dim() == 2 && rows.is_contiguous() && rows.scalar_type() == x.scalar_type() &&
                  rows.size(1) >= x.size(1),
              "rows must be a contiguous [capacity, >= ", x.size(1), "] tensor of x's dtype ",
              x.scalar_type(), ", got ", rows.scalar_type(), " of shape ", rows.sizes());
  UNIEP_CHECK((rows.size(1) * rows.element_size()) % 16 == 0,
              "rows' row stride must be a multiple of 16 bytes, got ",
              rows.size(1) * rows.element_size());
  UNIEP_CHECK(counters.dim() == 1 && counters.scalar_type() == at::kInt && counters.is_contiguous(),
              "counters must be a contiguous 1-D int32 tensor, got ", counters.scalar_type(),
              " of shape ", counters.sizes());
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{dest_rank, "dest_rank"},
                                {gemm_row, "gemm_row"},
                                {counter, "counter"},
                                {rows, "rows"},
                                {counters, "counters"}})
    check_same_device(t, name, x, "x");
}

void check_keep_first_errors_args(const std::vector<at::Tensor>& sticky,
                                  const std::vector<at::Tensor>& words) {
  UNIEP_CHECK(sticky.size() == words.size(), "sticky and words must be as long, got ",
              sticky.size(), " and ", words.size());
  for (size_t i = 0; i < sticky.size(); ++i) {
    const at::Tensor &s = sticky[i], &w = words[i];
    UNIEP_CHECK(w.scalar_type() == at::kLong || w.scalar_type() == at::kInt, "words[", i,
                "] must be int32 or int64, got ", w.scalar_type());
    UNIEP_CHECK(s.scalar_type() == w.scalar_type(), "sticky[", i, "] must be words[", i, "]'s ",
                w.scalar_type(), ", got ", s.scalar_type());
    UNIEP_CHECK(w.numel() >= 1 && s.numel() == w.numel(), "sticky[", i, "] and words[", i,
                "] must hold the same number (>= 1) of elements, got ", s.numel(), " and ",
                w.numel());
    UNIEP_CHECK(s.is_contiguous() && w.is_contiguous(), "sticky[", i, "] and words[", i,
                "] must be contiguous");
    UNIEP_CHECK(s.device() == w.device() && s.device() == sticky[0].device(), "sticky[", i,
                "] and words[", i, "] must be on sticky[0]'s device ", sticky[0].device(), ", got ",
                s.device(), " and ", w.device());
  }
}

namespace {

// sticky[i] = words[i] where sticky[i]'s first element is 0: the first error of any call kept.
void keep_first_errors_cpu(const std::vector<at::Tensor>& sticky,
                           const std::vector<at::Tensor>& words) {
  translate_errors([&] {
    check_keep_first_errors_args(sticky, words);
    for (size_t i = 0; i < sticky.size(); ++i) {
      at::Tensor s = sticky[i];
      if (s.reshape(-1)[0].item<int64_t>() == 0) s.copy_(words[i]);
    }
  });
}

}  // namespace
}  // namespace uniep::torch_glue

TORCH_LIBRARY_IMPL(uniep, CPU, m) {
  m.impl("keep_first_errors", &uniep::torch_glue::keep_first_errors_cpu);
  m.impl("sender_rows", &uniep::torch_glue::sender_rows_cpu);
  m.impl("send_order", &uniep::torch_glue::send_order_cpu);
  m.impl("expert_tiles", &uniep::torch_glue::expert_tiles_cpu);
  m.impl("local_plan", &uniep::torch_glue::local_plan_cpu);
  m.impl("send_rows", &uniep::torch_glue::send_rows_cpu);
  m.impl("combine_rows", &uniep::torch_glue::combine_rows_cpu);
}
