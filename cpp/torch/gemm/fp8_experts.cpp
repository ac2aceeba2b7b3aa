#include "torch/gemm/fp8_experts.hpp"

#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/intrusive_ptr.h>
#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "torch/gemm/fp8_weights.hpp"
#include "torch/gemm/grouped.hpp"
#include "uniep/status.hpp"

namespace uniep::torch_glue {
namespace {

// What a kept copy was made from: a tensor that may die (the weak reference then expires) or
// change in place (its version moves), or whose storage may be swapped (`w.data = other`: the
// storage, held weakly so that a new one never takes its identity, even at the same address; or
// the data pointer). Inference tensors have no version counter: an in-place update of one is not
// seen, and clear_fp8_experts drops the copies.
struct Source {
  c10::weak_intrusive_ptr<c10::TensorImpl> impl;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t version = -1;
  const void* data = nullptr;

  static Source of(const at::Tensor& w) {
    return {c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()),
            w.storage().getWeakStorageImpl(),
            w.is_inference() ? -1 : static_cast<int64_t>(w._version()), w.data_ptr()};
  }
  bool same(const Source& o) const {
    return !impl.expired() && impl._unsafe_get_target() == o.impl._unsafe_get_target() &&
           !storage.expired() && storage._unsafe_get_target() == o.storage._unsafe_get_target() &&
           version == o.version && data == o.data;
  }
};

// q1 and s1 packed for the first GEMM's SwiGLU epilogue (pack_gate_up_fp8).
struct Kept {
  Source w1, w2;
  at::Tensor q1, s1, q2, s2;
};

std::mutex& kept_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::pair<const void*, const void*>, Kept>& kept() {
  static std::map<std::pair<const void*, const void*>, Kept> k;
  return k;
}

// s1 and s2: what the copy is made from (Source::of(w1), Source::of(w2)).
Kept quantize_both(const at::Tensor& w1, const at::Tensor& w2, Source s1, Source s2) {
  Kept k{std::move(s1), std::move(s2), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  const auto [q1, q1_scales] = quantize_expert_weights(w1);
  std::tie(k.q1, k.s1) = pack_gate_up_fp8(q1, q1_scales);
  std::tie(k.q2, k.s2) = quantize_expert_weights(w2);
  return k;
}

Kept kept_for(const at::Tensor& w1, const at::Tensor& w2) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(
      c10::cuda::getCurrentCUDAStream(w1.device().index()).stream(), &capture));
  if (capture != cudaStreamCaptureStatusNone)
    // A kept copy would go stale between replays.
    return quantize_both(w1, w2, Source::of(w1), Source::of(w2));
  const auto key = std::make_pair(static_cast<const void*>(w1.unsafeGetTensorImpl()),
                                  static_cast<const void*>(w2.unsafeGetTensorImpl()));
  const Source s1 = Source::of(w1), s2 = Source::of(w2);
  std::lock_guard<std::mutex> lock(kept_mutex());
  auto& all = kept();
  auto it = all.find(key);
  if (it != all.end() && it->second.w1.same(s1) && it->second.w2.same(s2)) return it->second;
  // Copies of weights that died go with this miss, so the map holds live weights only.
  for (auto i = all.begin(); i != all.end();)
    i = i->second.w1.impl.expired() || i->second.w2.impl.expired() ? all.erase(i) : std::next(i);
  return all.insert_or_assign(key, quantize_both(w1, w2, s1, s2)).first->second;
}

}  // namespace

at::Tensor fp8_experts_forward(const at::Tensor& rows, const at::Tensor& row_scales,
                               const at::Tensor& offs, const at::Tensor& w1, const at::Tensor& w2,
                               const TuningParams& tuning, bool y_f32) {
  const Kept k = kept_for(w1, w2);
  // SwiGLU in the first GEMM's epilogue, then one pass quantizing [R, I] instead of SwiGLU and
  // quantization over [R, 2I]: the same bits as that chain, which uniep.moe.prepared's fp8 experts
  // run.
  const at::Tensor act = engine_grouped_mm_fp8(rows, row_scales, k.q1, k.s1, offs, tuning, true);
  const auto [act_q, act_scales] = engine_quantize_fp8(act);
  return engine_grouped_mm_fp8(act_q, act_scales, k.q2, k.s2, offs, tuning, false, y_f32);
}

void clear_fp8_experts() {
  std::lock_guard<std::mutex> lock(kept_mutex());
  kept().clear();
}

}  // namespace uniep::torch_glue
