// A multi-rank op's argument checks, shared with its peers before any collective work: every
// rank runs its own checks, then (on a group of several ranks) the ranks exchange their call
// signatures and verdicts (core/call_agreement.hpp), so one rank's bad argument is the same
// clear error on every rank at once instead of a hang in the first transfer.
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <string>
#include <vector>

#include "core/call_agreement.hpp"
#include "torch/common/process_group.hpp"
#include "uniep/tuning.hpp"

namespace uniep::torch_glue {

// Runs `check`, which validates this rank's arguments and returns the signature every rank must
// share. A uniep::Error it throws is shared with the peers, then rethrown here as it is. `device`:
// where the op's tensors are (an NCCL-only group stages the exchange there).
CallSignature check_and_agree(const Group& group, CallKind kind, c10::Device device,
                              const std::function<CallSignature()>& check);

// share_call over the group: every rank's values of `signature`'s fields, [W][F] row-major.
std::vector<int64_t> share_on_group(const Group& group, c10::Device device,
                                    const CallSignature& signature);

// The signature of moe_forward / moe_backward: dtypes, hidden, ffn, experts, top-k and tuning.
CallSignature moe_signature(CallKind kind, DType dtype, DType weight_dtype, const MoeShape& shape,
                            const TuningParams& tuning);

}  // namespace uniep::torch_glue
