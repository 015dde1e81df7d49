// How the collectives facade issues a collective and builds its Work
// (work.h): the backend-independent half of every collective. Internal to
// hp/distributed.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/distributed/collective_checks.h"
#include "hp/distributed/group.h"
#include "hp/distributed/shm_channel.h"
#include "hp/distributed/work.h"
#include "hp/util/torch_compat.h"

namespace c10d {
class Work;
}

namespace hp::dist::detail {

// What a collective is, for Work and for a failure message. `sizes` formats
// the arguments; it runs only for a message. `device`: the tensors' device
// (the CPU for a barrier).
struct LaunchInfo {
  const char* op;
  std::function<std::string()> sizes;
  CallFingerprint fingerprint;
  c10::Device device{c10::DeviceType::CPU};
  int64_t bytes = 0;  // what this rank sends, for the stream log
};

// Issues `issue` (which hands the tensors to the backend; null: nothing to
// communicate, a world of one) and returns its Work; `finish` is the local
// step that completes it on this rank. A backend exception becomes a
// CollectiveError. On NCCL the collective is queued on the current stream
// (c10d's asyncOp=false where this libtorch has it) and `finish` runs at
// once behind it; on Gloo both run on the backend's threads.
Work launch(Group& group, LaunchInfo info,
            const std::function<c10::intrusive_ptr<c10d::Work>()>& issue,
            std::function<void()> finish);

// As launch(), on the group's shared-memory channel.
Work launch_on_channel(Group& group, LaunchInfo info, ShmChannel::Op channel_op,
                       std::function<void()> finish);

// Sets c10d's asyncOp=false on `options` where this libtorch has the field
// (2.11 and later): NCCL then runs on the current stream with no stash.
template <typename Options>
Options stream_ordered(Options options) {
#if HP_TORCH_AT_LEAST(2, 11)
  options.asyncOp = false;
#endif
  return options;
}

}  // namespace hp::dist::detail
