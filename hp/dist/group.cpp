#include "hp/dist/group.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "hp/util/error.h"

namespace hp::dist {

Group::Group(std::vector<int> ranks, int global_rank, std::shared_ptr<c10d::ProcessGroup> backend,
             std::string name, std::chrono::milliseconds timeout)
    : ranks_(std::move(ranks)),
      backend_(std::move(backend)),
      name_(std::move(name)),
      timeout_(timeout) {
  auto it = std::find(ranks_.begin(), ranks_.end(), global_rank);
  rank_ = it == ranks_.end() ? -1 : static_cast<int>(it - ranks_.begin());
}

std::string Group::describe() const {
  return cat("group '", name_, "' ranks ", to_string(ranks_));
}

c10d::ProcessGroup& Group::backend() const {
  HP_CHECK_ARG(backend_ != nullptr, "this process is not a member of ", describe());
  return *backend_;
}

}  // namespace hp::dist
