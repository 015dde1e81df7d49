// The shared-memory channel's route (backend_collectives.h): ranks of one
// host move contiguous CPU tensors through one mapped segment, without
// Gloo's sockets (shm_channel.h).
#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "hp/distributed/backend_collectives.h"
#include "hp/distributed/shm_channel.h"

namespace hp::dist::detail {

bool on_channel(const Group& group, const at::Tensor& a, const at::Tensor& b) {
  return group.shm_channel() != nullptr && ShmChannel::carries(a) && ShmChannel::carries(b);
}

Work channel_all_gather(Group& group, LaunchInfo info, const at::Tensor& output,
                        const at::Tensor& input) {
  return launch_on_channel(group, std::move(info), {ShmChannel::Kind::kAllGather, input, output},
                           nullptr);
}

bool channel_carries_all(const Group& group, const std::vector<std::vector<at::Tensor>>& outputs,
                         const std::vector<at::Tensor>& inputs) {
  if (group.shm_channel() == nullptr) return false;
  // The channel copies bytes: it takes contiguous CPU tensors only (strided
  // outputs stay on Gloo, which copies into them).
  for (const at::Tensor& t : inputs) {
    if (!ShmChannel::carries(t)) return false;
  }
  for (const auto& row : outputs) {
    for (const at::Tensor& t : row) {
      if (!ShmChannel::carries(t) || !t.is_contiguous()) return false;
    }
  }
  return true;
}

Work channel_all_gather_coalesced(Group& group, LaunchInfo info,
                                  const std::vector<std::vector<at::Tensor>>& outputs,
                                  const std::vector<at::Tensor>& inputs) {
  ShmChannel::Op channel_op;
  channel_op.kind = ShmChannel::Kind::kAllGatherCoalesced;
  for (const at::Tensor& t : inputs) channel_op.inputs.push_back(t.contiguous());
  channel_op.outputs = outputs;
  return launch_on_channel(group, std::move(info), std::move(channel_op), nullptr);
}

Work channel_reduce_scatter(Group& group, LaunchInfo info, const at::Tensor& output,
                            const at::Tensor& input, ReduceOp op) {
  // Straight into the output: no group-size receive buffer, no local sum;
  // an average is the channel's sum divided afterwards.
  std::function<void()> divide_for_average;
  if (op == ReduceOp::kAvg) {
    divide_for_average = [output, size = group.size()] { output.div_(size); };
  }
  return launch_on_channel(group, std::move(info),
                           {ShmChannel::Kind::kReduceScatter, wire_view(input).view(-1),
                            wire_view(output).view(-1), op},
                           std::move(divide_for_average));
}

}  // namespace hp::dist::detail
