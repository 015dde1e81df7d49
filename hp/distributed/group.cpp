#include "hp/distributed/group.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "hp/distributed/p2p_state.h"
#include "hp/distributed/shm_channel.h"
#include "hp/util/error.h"

namespace hp::dist {

const char* to_string(BackendType backend) {
  return backend == BackendType::kNccl ? "nccl" : "gloo";
}

Group::Group(std::vector<int> ranks, int group_rank,
             std::shared_ptr<c10d::ProcessGroup> process_group, std::string name,
             std::chrono::milliseconds timeout, BackendType kind, c10::Device device,
             std::unique_ptr<ShmChannel> shm)
    : ranks_(std::move(ranks)),
      rank_(group_rank),
      process_group_(std::move(process_group)),
      name_(std::move(name)),
      timeout_(timeout),
      kind_(kind),
      device_(device),
      shm_(std::move(shm)),
      p2p_(std::make_unique<P2PState>(static_cast<int>(ranks_.size()))) {
  HP_CHECK_ARG(group_rank >= -1 && group_rank < static_cast<int>(ranks_.size()), "group '", name_,
               "': group rank ", group_rank, " is out of range for ranks ", to_string(ranks_),
               "; expected -1 (not a member) or an index into them");
  HP_CHECK_ARG((group_rank >= 0) == (process_group_ != nullptr), "group '", name_,
               "': group rank ", group_rank, " needs ",
               group_rank >= 0 ? "a process group" : "no process group");
  HP_CHECK_ARG(kind != BackendType::kNccl || device.is_cuda() || group_rank < 0, "group '", name_,
               "': an NCCL group's device must be a GPU, got ", device);
  description_ = std::make_shared<const std::string>(
      cat("group '", name_, "' ranks ", to_string(ranks_)));
}

Group::~Group() = default;

c10d::ProcessGroup& Group::process_group() const {
  HP_CHECK_ARG(process_group_ != nullptr, "this process is not a member of ", describe());
  return *process_group_;
}

}  // namespace hp::dist
