#include "torch/process_group.hpp"

#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <cstring>

#include "uniep/status.hpp"

namespace uniep::torch_glue {

Group resolve_group(const std::string& group_name) {
  Group g;
  if (group_name.empty()) return g;
  try {
    g.pg = c10d::resolve_process_group(group_name);
  } catch (const std::exception&) {
    UNIEP_CHECK(false, "group_name '", group_name,
                "' names no torch.distributed process group (pass group.group_name of an "
                "initialised group, or \"\" for a single rank)");
  }
  g.rank = g.pg->getRank();
  g.world_size = g.pg->getSize();
  return g;
}

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg)
    : pg_(std::move(pg)), rank_(pg_->getRank()), world_(pg_->getSize()) {}

void ProcessGroupTransport::all_gather(const int64_t* in, int64_t n, int64_t* out) {
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor input = at::empty({n}, opts);
  std::memcpy(input.data_ptr<int64_t>(), in, n * sizeof(int64_t));
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < world_; ++r) outputs[0].push_back(at::empty({n}, opts));
  pg_->allgather(outputs, inputs)->wait();
  for (int64_t r = 0; r < world_; ++r)
    std::memcpy(out + r * n, outputs[0][r].data_ptr<int64_t>(), n * sizeof(int64_t));
}

void ProcessGroupTransport::all_to_all(const uint8_t* send, const std::vector<int64_t>& send_bytes,
                                       uint8_t* recv, const std::vector<int64_t>& recv_bytes) {
  // Records are 8-byte multiples: move them as int64 words, a type every backend supports.
  std::vector<int64_t> send_words(world_), recv_words(world_);
  int64_t send_total = 0, recv_total = 0;
  for (int64_t r = 0; r < world_; ++r) {
    UNIEP_CHECK_CODE(send_bytes[r] % 8 == 0 && recv_bytes[r] % 8 == 0, StatusCode::kInternal,
                     "all_to_all sizes must be 8-byte multiples");
    send_words[r] = send_bytes[r] / 8;
    recv_words[r] = recv_bytes[r] / 8;
    send_total += send_words[r];
    recv_total += recv_words[r];
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor input = at::empty({send_total}, opts);
  at::Tensor output = at::empty({recv_total}, opts);
  if (send_total) std::memcpy(input.data_ptr(), send, send_total * 8);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  // alltoall_base is the name every supported torch has (all_to_all_single is 2.12+).
  pg_->alltoall_base(output, input, recv_words, send_words)->wait();
#pragma GCC diagnostic pop
  if (recv_total) std::memcpy(recv, output.data_ptr(), recv_total * 8);
}

}  // namespace uniep::torch_glue
