// Resolving the torch.distributed group an op names, and the Transport the CPU executor uses
// over it (gloo on CPU).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

#include "uniep/cpu_executor.hpp"

namespace uniep::torch_glue {

struct Group {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;  // null for "": a world of one rank
  int64_t rank = 0;
  int64_t world_size = 1;
};

// The same registry torch's own symm_mem ops resolve group names through.
Group resolve_group(const std::string& group_name);

class ProcessGroupTransport final : public Transport {
 public:
  explicit ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg);
  int64_t rank() const override { return rank_; }
  int64_t world_size() const override { return world_; }
  void all_gather(const int64_t* in, int64_t n, int64_t* out) override;
  void all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes, uint8_t* recv,
                  const std::vector<int64_t>& recv_bytes) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int64_t rank_, world_;
};

}  // namespace uniep::torch_glue
