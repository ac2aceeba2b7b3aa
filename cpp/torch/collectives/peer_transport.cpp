#include "torch/collectives/peer_transport.hpp"

#include <ATen/ops/from_blob.h>

#include <limits>
#include <vector>

#include "uniep/status.hpp"

namespace uniep::torch_glue {

namespace {

// The bytes as a 1-D uint8 tensor without a copy: gloo moves tensors as raw bytes.
at::Tensor byte_view(const void* data, int64_t bytes) {
  return at::from_blob(const_cast<void*>(data), {bytes}, at::TensorOptions().dtype(at::kByte));
}

int tag_of(int64_t chunk) {
  UNIEP_CHECK_CODE(chunk >= 0 && chunk <= std::numeric_limits<int>::max(), StatusCode::kInternal,
                   "chunk id ", chunk, " does not fit a message tag");
  return static_cast<int>(chunk);
}

}  // namespace

ProcessGroupPeerTransport::ProcessGroupPeerTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg)
    : pg_(pg), collectives_(std::move(pg), "the collective") {}

void ProcessGroupPeerTransport::all_gather(const int64_t* in, int64_t n, int64_t* out) {
  collectives_.all_gather(in, n, out);
}

void ProcessGroupPeerTransport::exchange(const std::vector<PeerSend>& sends,
                                         const std::vector<PeerRecv>& recvs) {
  // Every receive is posted with the sends before any is waited on: with all ranks doing the
  // same, no pair of ranks can block each other.
  std::vector<c10::intrusive_ptr<c10d::Work>> work;
  std::vector<std::vector<at::Tensor>> keep;
  keep.reserve(sends.size() + recvs.size());
  for (const PeerRecv& r : recvs) {
    keep.push_back({byte_view(r.data, r.bytes)});
    work.push_back(pg_->recv(keep.back(), static_cast<int>(r.peer), tag_of(r.tag)));
  }
  for (const PeerSend& s : sends) {
    keep.push_back({byte_view(s.data, s.bytes)});
    work.push_back(pg_->send(keep.back(), static_cast<int>(s.peer), tag_of(s.tag)));
  }
  for (auto& w : work) wait_bounded(w, "the collective's transfer", *pg_);
}

std::unique_ptr<PeerTransport> make_peer_transport(const Group& group) {
  if (!group.pg) return std::make_unique<LocalPeerTransport>();
  return std::make_unique<ProcessGroupPeerTransport>(group.pg);
}

}  // namespace uniep::torch_glue
