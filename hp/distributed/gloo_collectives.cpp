// Gloo's route (backend_collectives.h), with what c10d's Gloo lacks:
//  - 1.13's refuses bf16, bool and int16: their bytes travel as a same-size
//    type (wire_view), bit-exact for moves;
//  - bf16 and fp16 are reduced in fp32 and rounded once (more accurate than
//    a native sum: docs/streams.md gives both bounds);
//  - 1.13's has no reduce-scatter: one all-to-all (the same bytes on the
//    wire as a ring reduce-scatter) and a local reduction;
//  - a flat all-gather only where this libtorch's Gloo has one (CPU).
// The channel's all-reduce shares the fp32 handling (host_all_reduce).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <utility>
#include <vector>

#include "hp/distributed/backend_collectives.h"
#include "hp/distributed/shm_channel.h"
#include "hp/util/torch_compat.h"

namespace hp::dist::detail {

Work gloo_all_gather(Group& group, LaunchInfo info, const at::Tensor& output,
                     const at::Tensor& input) {
  if (compat::gloo_has_flat_all_gather() && input.is_cpu()) {
    return launch(group, std::move(info), [&group, output, input] {
      at::Tensor flat_out = wire_view(output).view(-1);
      at::Tensor flat_in = wire_view(input).view(-1);
      return group.process_group()._allgather_base(flat_out, flat_in,
                                                   options_for<c10d::AllgatherOptions>(group));
    }, nullptr);
  }
  // Into a list of views of the output: no copy after.
  const int64_t n = input.numel();
  return launch(group, std::move(info), [&group, output, input, n] {
    at::Tensor flat_out = wire_view(output).view(-1);
    std::vector<std::vector<at::Tensor>> outputs(1);
    outputs[0].reserve(group.size());
    for (int r = 0; r < group.size(); ++r) outputs[0].push_back(flat_out.narrow(0, r * n, n));
    std::vector<at::Tensor> inputs{wire_view(input).view(-1)};
    return group.process_group().allgather(outputs, inputs,
                                           options_for<c10d::AllgatherOptions>(group));
  }, nullptr);
}

Work gloo_all_gather_coalesced(Group& group, LaunchInfo info,
                               const std::vector<std::vector<at::Tensor>>& outputs,
                               const std::vector<at::Tensor>& inputs) {
  return launch(group, std::move(info), [&group, outputs, inputs] {
    // The backend flattens the inputs, gathers once and copies each piece
    // into outputs[r][i] (as copy_, so strided views work); shapes must
    // match the inputs exactly. Those two host copies were measured against
    // writing the gather as Gloo sends and receives straight into the
    // outputs (one per parameter and peer, no copy): on 2 ranks of 2 cores
    // the transfers cost more kernel time (a message, a ready notice and a
    // wake-up each) than the copies they save, and the step was no faster.
    std::vector<std::vector<at::Tensor>> out(outputs.size());
    for (size_t r = 0; r < outputs.size(); ++r) {
      for (size_t i = 0; i < inputs.size(); ++i) {
        out[r].push_back(wire_view(outputs[r][i]).view_as(wire_view(inputs[i])));
      }
    }
    std::vector<at::Tensor> in;
    for (const auto& t : inputs) in.push_back(wire_view(t));
    return group.process_group().allgather_coalesced(out, in);
  }, nullptr);
}

Work gloo_reduce_scatter(Group& group, LaunchInfo info, const at::Tensor& output,
                         const at::Tensor& input, ReduceOp op, const at::Tensor& scratch) {
  const int size = group.size();
  const int64_t n = output.numel();
  // Low-precision data travels as its own bits and is summed in fp32 here.
  const bool low = is_low_precision(input.scalar_type());
  at::Tensor send = wire_view(input).view(-1);
  at::Tensor recv = scratch.defined() ? wire_view(scratch).view(-1).narrow(0, 0, size * n)
                                      : at::empty({size * n}, send.options());
  auto finish = [output, recv, size, n, op, low, dtype = input.scalar_type()] {
    at::Tensor chunks = (low ? recv.view(dtype).to(at::kFloat) : recv.view(dtype)).view({size, n});
    at::Tensor out = output.view(-1);
    at::Tensor reduced;
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        reduced = low ? chunks.sum(0) : at::sum_out(out, chunks, {0});
        if (op == ReduceOp::kAvg) reduced.div_(size);
        break;
      case ReduceOp::kMax: reduced = low ? chunks.amax(0) : at::amax_out(out, chunks, {0}); break;
      case ReduceOp::kMin: reduced = low ? chunks.amin(0) : at::amin_out(out, chunks, {0}); break;
    }
    if (low) out.copy_(reduced);
  };
  return launch(group, std::move(info), [&group, send, recv] {
    at::Tensor s = send, r = recv;
    std::vector<int64_t> equal_splits;
    return group.process_group().alltoall_base(r, s, equal_splits, equal_splits,
                                               options_for<c10d::AllToAllOptions>(group));
  }, std::move(finish));
}

Work host_all_reduce(Group& group, LaunchInfo info, const at::Tensor& tensor, ReduceOp op) {
  // bf16 and fp16 are reduced (and averaged) in fp32 and copied back, as in
  // gloo_reduce_scatter; bool reduces as bytes.
  const int size = group.size();
  const bool low = is_low_precision(tensor.scalar_type());
  at::Tensor buffer = low ? tensor.to(at::kFloat) : wire_view(tensor);
  std::function<void()> finish;
  if (low || op == ReduceOp::kAvg) {
    finish = [tensor, buffer, low, size, op] {
      if (op == ReduceOp::kAvg) buffer.div_(size);
      if (low) tensor.copy_(buffer);
    };
  }
  if (on_channel(group, buffer, buffer)) {
    return launch_on_channel(group, std::move(info),
                             {ShmChannel::Kind::kAllReduce, buffer.view(-1), {}, op},
                             std::move(finish));
  }
  return launch(group, std::move(info), [&group, buffer, op] {
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    return group.process_group().allreduce(tensors, options);
  }, std::move(finish));
}

}  // namespace hp::dist::detail
