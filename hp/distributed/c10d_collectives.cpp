// The calls c10d's NCCL and Gloo take alike (backend_collectives.h), and
// what both c10d routes share. Bytes go through wire_view, which NCCL does
// not need and does not mind (a same-size view).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <utility>
#include <vector>

#include "hp/distributed/backend_collectives.h"

namespace hp::dist::detail {

at::Tensor wire_view(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return t.view(at::kHalf);
    case at::kBool: return t.view(at::kByte);
    default: return t;
  }
}

bool is_low_precision(at::ScalarType type) {
  return type == at::kBFloat16 || type == at::kHalf;
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

Work packed_all_gather_coalesced(Group& group, LaunchInfo info,
                                 const std::vector<std::vector<at::Tensor>>& outputs,
                                 const std::vector<at::Tensor>& inputs, int64_t numel) {
  // What Gloo's coalesced gather does inside for CPU tensors.
  std::vector<at::Tensor> flat;
  for (const auto& t : inputs) flat.push_back(wire_view(t.contiguous()).view(-1));
  at::Tensor packed = at::cat(flat);
  at::Tensor gathered = at::empty({group.size() * numel}, packed.options());
  auto unpack = [outputs, inputs, gathered, numel] {
    for (size_t r = 0; r < outputs.size(); ++r) {
      int64_t offset = static_cast<int64_t>(r) * numel;
      for (size_t i = 0; i < inputs.size(); ++i) {
        const int64_t n = inputs[i].numel();
        at::Tensor piece = gathered.narrow(0, offset, n).view(inputs[i].scalar_type());
        outputs[r][i].copy_(piece.view(outputs[r][i].sizes()));
        offset += n;
      }
    }
  };
  return launch(group, std::move(info), [&group, packed, gathered, numel] {
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < group.size(); ++r) out[0].push_back(gathered.narrow(0, r * numel, numel));
    std::vector<at::Tensor> in{packed};
    return group.process_group().allgather(out, in, options_for<c10d::AllgatherOptions>(group));
  }, std::move(unpack));
}

Work c10d_broadcast(Group& group, LaunchInfo info, const at::Tensor& tensor, int source) {
  return launch(group, std::move(info), [&group, tensor, source] {
    std::vector<at::Tensor> tensors{wire_view(tensor)};
    c10d::BroadcastOptions options = options_for<c10d::BroadcastOptions>(group);
    options.rootRank = source;
    return group.process_group().broadcast(tensors, options);
  }, nullptr);
}

Work c10d_all_to_all(Group& group, LaunchInfo info, const at::Tensor& output,
                     const at::Tensor& input, const std::vector<int64_t>& output_splits,
                     const std::vector<int64_t>& input_splits) {
  return launch(group, std::move(info), [&group, output, input, output_splits, input_splits] {
    at::Tensor o = wire_view(output), i = wire_view(input);
    std::vector<int64_t> os = output_splits, is = input_splits;
    return group.process_group().alltoall_base(o, i, os, is,
                                               options_for<c10d::AllToAllOptions>(group));
  }, nullptr);
}

Work c10d_barrier(Group& group, LaunchInfo info) {
  return launch(group, std::move(info), [&group] { return group.process_group().barrier(); },
                nullptr);
}

}  // namespace hp::dist::detail
