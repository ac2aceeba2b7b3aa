#include "torch/common/process_group.hpp"

#include <ATen/ops/empty.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "uniep/status.hpp"

namespace uniep::torch_glue {

namespace {
std::mutex topology_mutex;
std::map<std::string, int64_t>& topologies() {
  static std::map<std::string, int64_t> by_group;
  return by_group;
}
std::map<std::string, std::vector<int64_t>>& global_ranks() {
  static std::map<std::string, std::vector<int64_t>> by_group;
  return by_group;
}
}  // namespace

void set_group_ranks(const std::string& group_name, const std::vector<int64_t>& ranks) {
  std::lock_guard<std::mutex> lock(topology_mutex);
  if (ranks.empty())
    global_ranks().erase(group_name);
  else
    global_ranks()[group_name] = ranks;
}

std::string group_ranks_note(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(topology_mutex);
  const auto it = global_ranks().find(group_name);
  if (it == global_ranks().end()) return "";
  std::string list;
  for (size_t i = 0; i < it->second.size(); ++i)
    list += detail::str_cat(i ? ", " : "", it->second[i]);
  return detail::str_cat(" [ranks are numbered within group '", group_name,
                         "', whose ranks 0, 1, ... are global ranks ", list, "]");
}

Error with_group_ranks(const Error& e, const std::string& group_name) {
  const std::string what = e.what(), note = group_ranks_note(group_name);
  if (note.empty() || what.find("rank ") == std::string::npos ||
      what.find(note) != std::string::npos)
    return e;
  return Error(e.code(), what + note);
}

void set_ranks_per_node(const std::string& group_name, int64_t ranks_per_node) {
  UNIEP_CHECK(ranks_per_node >= 0, "ranks_per_node must be >= 1 (0: one node), got ",
              ranks_per_node);
  std::lock_guard<std::mutex> lock(topology_mutex);
  if (ranks_per_node == 0)
    topologies().erase(group_name);
  else
    topologies()[group_name] = ranks_per_node;
}

int64_t ranks_per_node(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(topology_mutex);
  const auto it = topologies().find(group_name);
  return it == topologies().end() ? 0 : it->second;
}

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
  g.ranks_per_node = ranks_per_node(group_name);
  return g;
}

double host_timeout_s() {
  constexpr double kDefault = 100.0;
  const char* env = std::getenv("UNIEP_TIMEOUT_S");
  if (env == nullptr || *env == '\0') return kDefault;
  char* end = nullptr;
  const double v = std::strtod(env, &end);
  UNIEP_CHECK(end != env && *end == '\0' && v > 0, "UNIEP_TIMEOUT_S must be a number of seconds ",
              "> 0, got '", env, "'");
  return v;
}

void wait_bounded(const c10::intrusive_ptr<c10d::Work>& work, const std::string& op,
                  const c10d::ProcessGroup& pg) {
  using Clock = std::chrono::steady_clock;
  const double limit = host_timeout_s();
  const auto start = Clock::now();
  try {
    // The backends bound this wait themselves (gloo's send/recv work never reports completion
    // through isCompleted, so polling it would spin to the deadline); it throws at the limit.
    work->wait(std::chrono::milliseconds(static_cast<int64_t>(limit * 1000.0)));
  } catch (const std::exception& e) {
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    UNIEP_CHECK_CODE(waited < limit, StatusCode::kTimeout, op, " on rank ", pg.getRank(),
                     " of group '", pg.getGroupName(), "' (", pg.getSize(),
                     " ranks) timed out after ", limit,
                     " s waiting for its peers (did every rank of the group call it? a rank "
                     "that raised before joining, or a backward run on some ranks only, leaves "
                     "the others here); UNIEP_TIMEOUT_S sets the limit",
                     group_ranks_note(pg.getGroupName()));
    UNIEP_CHECK_CODE(false, StatusCode::kInternal, op, " on rank ", pg.getRank(),
                     ": the exchange over group '", pg.getGroupName(), "' failed: ", e.what());
  }
}

namespace {
// CPU staging where the group has a CPU backend (gloo): no device round trip for a few words.
c10::Device staging_device(const c10d::ProcessGroup& pg, c10::Device data) {
  for (const c10::Device& d : pg.getDeviceTypes())
    if (d.type() == c10::kCPU) return c10::Device(c10::kCPU);
  return data;
}
}  // namespace

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                             std::string op, c10::Device device)
    : pg_(std::move(pg)),
      rank_(pg_->getRank()),
      world_(pg_->getSize()),
      op_(std::move(op)),
      staging_(staging_device(*pg_, device)) {}

void ProcessGroupTransport::all_gather(const int64_t* in, int64_t n, int64_t* out) {
  const auto host = at::TensorOptions().dtype(at::kLong);
  at::Tensor input = at::empty({n}, host);
  std::memcpy(input.data_ptr<int64_t>(), in, n * sizeof(int64_t));
  input = input.to(staging_);
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int64_t r = 0; r < world_; ++r) outputs[0].push_back(at::empty({n}, input.options()));
  wait_bounded(pg_->allgather(outputs, inputs), op_, *pg_);
  for (int64_t r = 0; r < world_; ++r) {
    const at::Tensor got = outputs[0][r].to(at::kCPU);
    std::memcpy(out + r * n, got.data_ptr<int64_t>(), n * sizeof(int64_t));
  }
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
  if (send_total) std::memcpy(input.data_ptr(), send, send_total * 8);
  input = input.to(staging_);
  at::Tensor output = at::empty({recv_total}, input.options());
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  // alltoall_base is the name every supported torch has (all_to_all_single is 2.12+).
  wait_bounded(pg_->alltoall_base(output, input, recv_words, send_words), op_, *pg_);
#pragma GCC diagnostic pop
  if (recv_total) std::memcpy(recv, output.to(at::kCPU).data_ptr(), recv_total * 8);
}

}  // namespace uniep::torch_glue
