// How the collectives facade issues a collective and builds its Work
// (work.h): the backend-independent half of every collective. Internal to
// hp/distributed.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/distributed/collective_checks.h"
#include "hp/distributed/group.h"
#include "hp/distributed/op_type.h"
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

// What a point-to-point op (or a coalesced batch of them) is, for its Work
// and a failure message (p2p.h). It claims no sequence number of the group
// and is not compared across ranks; `sequence` is its number among this
// rank's ops of that direction with `peer`.
struct P2PInfo {
  const char* op;  // "send", "recv", "batch_p2p"
  std::function<std::string()> sizes;
  int peer = -1;  // group rank; -1 for a coalesced batch (sizes names each op)
  uint64_t sequence = 0;
  c10::Device device{c10::DeviceType::CPU};
  int64_t bytes = 0;
  int sends = 0, recvs = 0;  // what comm_stats counts
};

// Blocks until a host-path op finished, for at most `timeout`, and raises
// its error.
using P2PWaiter = std::function<void(std::chrono::milliseconds timeout)>;

// Host path (Gloo): `issue` posts the op and returns its waiter (null:
// nothing to wait for), which the Work's first wait() runs on the waiting
// thread with the group's timeout, then `finish`. Gloo's sends and
// receives report completion to no future, so until then the Work is not
// completed. An exception of `issue` becomes a CollectiveError.
Work launch_p2p(Group& group, P2PInfo info, const std::function<P2PWaiter()>& issue,
                std::function<void()> finish);

// Stream path (NCCL): as launch(), for the c10d Work that `issue` returns
// (the current stream waits for it at once).
Work launch_p2p_on_stream(Group& group, P2PInfo info,
                          const std::function<c10::intrusive_ptr<c10d::Work>()>& issue);

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
