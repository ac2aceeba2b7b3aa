// Resolving the torch.distributed group an op names, and the Transport the CPU executor uses
// over it (gloo on CPU).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>
#include <vector>

#include "torch/common/validate.hpp"
#include "uniep/cpu_executor.hpp"

namespace uniep::torch_glue {

struct Group {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null for "": a world of one rank
  int64_t rank = 0;
  int64_t world_size = 1;
  // Ranks per node as set_ranks_per_node recorded for the group (MoeShape::ranks_per_node);
  // 0: the group is one node.
  int64_t ranks_per_node = 0;
};

// The same registry torch's own symm_mem ops resolve group names through.
Group resolve_group(const std::string& group_name);

// The topology of a group (uniep.init(group, ranks_per_node=...)): the ops on it read it from
// here, so their schemas need no topology argument. 0 forgets it (one node). Checked against the
// group's size when a call resolves the group (MoeShape::validate).
void set_ranks_per_node(const std::string& group_name, int64_t ranks_per_node);
int64_t ranks_per_node(const std::string& group_name);

// The global ranks of a sub-group's ranks, in group rank order (uniep.distributed records them
// at a group's first use; empty forgets them). The ranks an error names are the group's own:
// group_ranks_note says which global ranks those are, "" for a group with none recorded.
void set_group_ranks(const std::string& group_name, const std::vector<int64_t>& global_ranks);
std::string group_ranks_note(const std::string& group_name);
// `e` with group_ranks_note appended where its message names a rank ("rank N") and lacks the
// note; `e` itself otherwise (a group with none recorded, or a message naming no rank).
Error with_group_ranks(const Error& e, const std::string& group_name);

// translate_errors for an op on the group `group_name`: the errors that name ranks (the group's
// own numbers) also say which global ranks those are (with_group_ranks). Not only the call
// agreement's: the executors' exchanges and the runtimes' waits name ranks too.
template <typename Fn>
auto translate_errors_on(c10::string_view group_name, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    rethrow_as_torch_error(with_group_ranks(e, std::string(group_name)));
  }
}

// Seconds a host wait on a group may take before it raises: UNIEP_TIMEOUT_S (the limit of the
// device-side waits too), default 100.
double host_timeout_s();

// Waits for `work` until host_timeout_s() has passed, then throws kTimeout naming `op` (the
// call, say "moe_forward") and the group: a peer that never joins makes this rank raise instead
// of waiting for the backend's own timeout (gloo's is 30 minutes). The group is unusable after
// that, as after any failed collective.
void wait_bounded(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op,
                  const c10d::ProcessGroup& pg);

// The all-gathers and all-to-alls of the CPU executor and of the call agreement over a process
// group, every wait bounded. Their staging tensors are on the CPU when the group has a CPU
// backend (gloo), else on `device` (an NCCL-only group of a CUDA op).
class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                 std::string op = "the exchange",
                                 c10::Device device = c10::Device(c10::kCPU));
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_; }
  void all_gather(const int64_t* in, int64_t n, int64_t* out) override;
  void all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes, uint8_t* recv,
                  const std::vector<int64_t>& recv_bytes) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_, world_;
  std::string op_;
  c10::Device staging_;
};

}  // namespace uniep::torch_glue
