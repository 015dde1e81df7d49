#include "hp/dist/group.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "hp/util/error.h"

namespace hp::dist {

const char* to_string(Backend backend) { return backend == Backend::kNccl ? "nccl" : "gloo"; }

Group::Group(std::vector<int> ranks, int group_rank, std::shared_ptr<c10d::ProcessGroup> backend,
             std::string name, std::chrono::milliseconds timeout, Backend kind,
             c10::Device device)
    : ranks_(std::move(ranks)),
      rank_(group_rank),
      backend_(std::move(backend)),
      name_(std::move(name)),
      timeout_(timeout),
      kind_(kind),
      device_(device) {
  HP_CHECK_ARG(group_rank >= -1 && group_rank < static_cast<int>(ranks_.size()), "group '", name_,
               "': group rank ", group_rank, " is out of range for ranks ", to_string(ranks_),
               "; expected -1 (not a member) or an index into them");
  HP_CHECK_ARG((group_rank >= 0) == (backend_ != nullptr), "group '", name_, "': group rank ",
               group_rank, " needs ", group_rank >= 0 ? "a backend" : "no backend");
  HP_CHECK_ARG(kind != Backend::kNccl || device.is_cuda() || group_rank < 0, "group '", name_,
               "': an NCCL group's device must be a GPU, got ", device);
  description_ = std::make_shared<const std::string>(
      cat("group '", name_, "' ranks ", to_string(ranks_)));
}

c10d::ProcessGroup& Group::backend() const {
  HP_CHECK_ARG(backend_ != nullptr, "this process is not a member of ", describe());
  return *backend_;
}

}  // namespace hp::dist
