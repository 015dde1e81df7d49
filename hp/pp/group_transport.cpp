#include <memory>

#include "hp/distributed/p2p.h"
#include "hp/pp/transport.h"
#include "hp/util/error.h"

namespace hp::pp {

namespace {

class WorkHandle : public TransferHandle {
 public:
  explicit WorkHandle(dist::Work work) : work_(std::move(work)) {}
  void wait() override { work_.wait(); }

 private:
  dist::Work work_;
};

}  // namespace

GroupTransport::GroupTransport(dist::GroupPtr group) : group_(std::move(group)) {
  HP_CHECK_ARG(group_ && group_->is_member(), "GroupTransport: this process is not a member of ",
               group_ ? group_->describe() : std::string("a null group"));
}

int GroupTransport::rank() const { return group_->rank(); }
int GroupTransport::size() const { return group_->size(); }
int GroupTransport::global_rank(int peer) const { return group_->global_rank(peer); }

std::unique_ptr<TransferHandle> GroupTransport::send(const at::Tensor& tensor, int peer, int tag) {
  return std::make_unique<WorkHandle>(dist::send(*group_, tensor, peer, tag));
}

std::unique_ptr<TransferHandle> GroupTransport::recv(const at::Tensor& tensor, int peer, int tag) {
  return std::make_unique<WorkHandle>(dist::recv(*group_, tensor, peer, tag));
}

std::vector<std::unique_ptr<TransferHandle>> GroupTransport::post(
    const std::vector<Transfer>& transfers) {
  std::vector<dist::P2PRequest> requests;
  requests.reserve(transfers.size());
  for (const Transfer& t : transfers)
    requests.push_back({t.send ? dist::P2POp::kSend : dist::P2POp::kRecv, t.tensor, t.peer, t.tag});
  std::vector<std::unique_ptr<TransferHandle>> handles;
  for (dist::Work& work : dist::batch_p2p(*group_, requests))
    handles.push_back(std::make_unique<WorkHandle>(std::move(work)));
  return handles;
}

}  // namespace hp::pp
