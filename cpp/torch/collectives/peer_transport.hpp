// The PeerTransport of the collective schedules over a c10d ProcessGroup (gloo on CPU): each step's
// chunks move as point-to-point send/recv, tagged with their chunk id.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

#include "torch/common/process_group.hpp"
#include "uniep/collectives.hpp"

namespace uniep::torch_glue {

class ProcessGroupPeerTransport final : public PeerTransport {
 public:
  explicit ProcessGroupPeerTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg);
  int64_t rank() const override { return collectives_.rank(); }
  int64_t world_size() const override { return collectives_.world_size(); }
  void all_gather(const int64_t* in, int64_t n, int64_t* out) override;
  void exchange(const std::vector<PeerSend>& sends, const std::vector<PeerRecv>& recvs) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  ProcessGroupTransport collectives_;  // the header all-gather, shared with the MoE executor
};

// LocalPeerTransport for "" (a world of one rank), else the process group's.
std::unique_ptr<PeerTransport> make_peer_transport(const Group& group);

}  // namespace uniep::torch_glue
