// Cross-rank agreement on a multi-rank call, before any of its collective work: every rank
// exchanges a fixed-size signature of its call (which op, the argument properties every rank must
// share, and the verdict of its own argument checks with that error's text). A bad argument on
// one rank then becomes the same clear error on every rank at once, and a rank that is in another
// call (a backward run on some ranks only) is named, instead of the peers waiting in a transfer
// that never comes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "uniep/cpu_executor.hpp"
#include "uniep/status.hpp"

namespace uniep {

// The multi-rank calls that agree through this signature.
enum class CallKind : int64_t {
  kMoeForward = 1,
  kMoeBackward = 2,
  kEpRuntimeCreate = 3,
  // Values each rank reads whole rather than agrees on (share_call): moe_forward's checksums of
  // the trainable expert shards, where equal on every rank means a DDP copy.
  kExpertShardCheck = 4,
};
const char* call_kind_name(CallKind kind);

// One value every rank must share, with an optional way to print it (dtype names, say).
struct CallField {
  const char* name;
  int64_t value;
  std::string (*describe)(int64_t) = nullptr;
};

struct CallSignature {
  CallKind kind;
  std::vector<CallField> fields;  // at most kMaxCallFields
};

constexpr int64_t kMaxCallFields = 24;

// Describes a DType field by name.
std::string describe_dtype(int64_t dtype);

// Exchanges the signatures over `transport` (one all_gather of a fixed number of words) and
// throws on every rank when any rank's checks failed, when a rank is in another call, or when a
// field differs (naming the field and both values). local_error: this rank's failed check (null
// if they passed), rethrown here as it is after the exchange; a peer's is quoted with its rank,
// as kInvalidArgument (ValueError in Python), like the other disagreements.
void agree_on_call(const CallSignature& signature, const Error* local_error, Transport& transport);

// The same exchange, throwing alike on a failed check or a rank in another call, but the fields
// are left to the caller: returns every rank's values, [W][F] row-major. For calls whose ranks
// compare the values themselves; sharing agree_on_call's fixed-size message, a rank in another
// call is still named instead of the exchange pairing with that call's.
std::vector<int64_t> share_call(const CallSignature& signature, const Error* local_error,
                                Transport& transport);

}  // namespace uniep
