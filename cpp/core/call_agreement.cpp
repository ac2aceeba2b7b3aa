#include "core/call_agreement.hpp"

#include <algorithm>
#include <cstring>

#include "uniep/status.hpp"

namespace uniep {
namespace {

// [magic, kind, verdict, error bytes, fields..., error text...]: the same length for every call,
// so ranks in different calls still exchange matching buffers and can name each other's call.
constexpr int64_t kMagic = 0x756e6965704167;  // "uniepAg"
constexpr int64_t kHead = 4;
constexpr int64_t kErrorBytes = 480;
constexpr int64_t kWords = kHead + kMaxCallFields + kErrorBytes / 8;

std::string field_text(const CallField& f, int64_t value) {
  return f.describe != nullptr ? f.describe(value) : std::to_string(value);
}

}  // namespace

const char* call_kind_name(CallKind kind) {
  switch (kind) {
    case CallKind::kMoeForward:
      return "moe_forward";
    case CallKind::kMoeBackward:
      return "moe_backward";
    case CallKind::kEpRuntimeCreate:
      return "the GPU runtime's creation (uniep.moe.ep.init_runtime)";
    case CallKind::kExpertShardCheck:
      return "moe_forward's check of the expert shards (uniep.moe.expert_shards, on a layer's "
             "first call with autograd on)";
  }
  return "an unknown call";
}

std::string describe_dtype(int64_t dtype) {
  switch (static_cast<DType>(dtype)) {
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat64:
      return dtype_name(static_cast<DType>(dtype));
  }
  return "dtype #" + std::to_string(dtype);
}

std::vector<int64_t> share_call(const CallSignature& signature, const Error* local_error,
                                Transport& transport) {
  const int64_t W = transport.world_size(), me = transport.rank();
  const int64_t F = static_cast<int64_t>(signature.fields.size());
  UNIEP_CHECK_CODE(F <= kMaxCallFields, StatusCode::kInternal, "a call signature holds at most ",
                   kMaxCallFields, " fields, got ", F);
  const char* op = call_kind_name(signature.kind);
  const std::string text = local_error != nullptr ? local_error->what() : "";
  std::vector<int64_t> mine(kWords, 0);
  const int64_t error_bytes = std::min<int64_t>(text.size(), kErrorBytes);
  mine[0] = kMagic;
  mine[1] = static_cast<int64_t>(signature.kind);
  mine[2] = local_error == nullptr ? 1 : 0;
  mine[3] = error_bytes;
  for (int64_t i = 0; i < F; ++i) mine[kHead + i] = signature.fields[i].value;
  std::memcpy(&mine[kHead + kMaxCallFields], text.data(), error_bytes);

  std::vector<int64_t> all(W * kWords);
  transport.all_gather(mine.data(), kWords, all.data());
  // Our own error first, as the check wrote it (it names the argument).
  if (local_error != nullptr) throw *local_error;
  for (int64_t r = 0; r < W; ++r) {
    const int64_t* o = &all[r * kWords];
    UNIEP_CHECK_CODE(o[0] == kMagic, StatusCode::kInternal, op, ": rank ", r,
                     " sent no call signature (a different UniEP or a different collective in "
                     "the same slot?); every rank of the group must make the same calls in the "
                     "same order");
  }
  // A peer's failed check first: its message is the most useful, whatever call it was in.
  for (int64_t r = 0; r < W; ++r) {
    const int64_t* o = &all[r * kWords];
    if (o[2] == 1) continue;
    const int64_t bytes = std::clamp<int64_t>(o[3], 0, kErrorBytes);
    std::string theirs(reinterpret_cast<const char*>(o + kHead + kMaxCallFields), bytes);
    UNIEP_CHECK(false, op, " on rank ", me, ": rank ", r, " failed its argument checks in ",
                call_kind_name(static_cast<CallKind>(o[1])), ": ", theirs);
  }
  for (int64_t r = 0; r < W; ++r) {
    const int64_t* o = &all[r * kWords];
    UNIEP_CHECK(o[1] == mine[1], op, " on rank ", me, ": rank ", r, " called ",
                call_kind_name(static_cast<CallKind>(o[1])),
                " at the same time; every rank of the group must make the same calls in the "
                "same order (a backward run on some ranks only?)");
  }
  std::vector<int64_t> values(W * F);
  for (int64_t r = 0; r < W; ++r) std::copy_n(&all[r * kWords + kHead], F, &values[r * F]);
  return values;
}

void agree_on_call(const CallSignature& signature, const Error* local_error, Transport& transport) {
  const std::vector<int64_t> values = share_call(signature, local_error, transport);
  const int64_t W = transport.world_size();
  const int64_t F = static_cast<int64_t>(signature.fields.size());
  const char* op = call_kind_name(signature.kind);
  // Against rank 0's values, so that every rank raises the same message.
  for (int64_t i = 0; i < F; ++i) {
    const CallField& f = signature.fields[i];
    const int64_t first = values[i];
    for (int64_t r = 1; r < W; ++r) {
      const int64_t theirs = values[r * F + i];
      UNIEP_CHECK(theirs == first, op, ": ", f.name, " differs across ranks: rank 0 has ",
                  field_text(f, first), ", rank ", r, " has ", field_text(f, theirs),
                  "; every rank of the group must pass the same");
    }
  }
}

}  // namespace uniep
