// NCCL's route (backend_collectives.h): one native call each, queued on the
// current stream (stream_ordered), bf16 and fp16 reduced in their own dtype
// with NCCL's own average or fp16's division before and after
// (native_average.h). No dtype travels as another: NCCL has them all.
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <functional>
#include <utility>
#include <vector>

#include "hp/distributed/backend_collectives.h"
#include "hp/distributed/native_average.h"

namespace hp::dist::detail {

Work nccl_all_gather(Group& group, LaunchInfo info, const at::Tensor& output,
                     const at::Tensor& input) {
  return launch(group, std::move(info), [&group, output, input] {
    at::Tensor flat_out = output.view(-1), flat_in = input.view(-1);
    return group.process_group()._allgather_base(flat_out, flat_in,
                                                 options_for<c10d::AllgatherOptions>(group));
  }, nullptr);
}

Work nccl_reduce_scatter(Group& group, LaunchInfo info, const at::Tensor& output,
                         const at::Tensor& input, ReduceOp op) {
  // One reduce-scatter into the output itself (no group-size receive
  // buffer).
  c10d::ReduceScatterOptions options = options_for<c10d::ReduceScatterOptions>(group);
  options.reduceOp = to_c10d(op);
  std::function<void()> post;
  at::Tensor send = input;
  if (op == ReduceOp::kAvg) {
    const NativeAverage average = native_average(input.scalar_type(), group.size());
    if (average.backend_average) {
      options.reduceOp = c10d::ReduceOp::AVG;
    } else {
      if (average.pre > 1) send = input / average.pre;
      post = [output, after = average.post] { output.div_(after); };
    }
  }
  return launch(group, std::move(info), [&group, output, send, options] {
    at::Tensor out = output.view(-1), flat_in = send.view(-1);
    return group.process_group()._reduce_scatter_base(out, flat_in, options);
  }, std::move(post));
}

Work nccl_all_reduce(Group& group, LaunchInfo info, const at::Tensor& tensor, ReduceOp op) {
  c10d::AllreduceOptions options = options_for<c10d::AllreduceOptions>(group);
  options.reduceOp = to_c10d(op);
  std::function<void()> post;
  int pre = 1;
  if (op == ReduceOp::kAvg) {
    const NativeAverage average = native_average(tensor.scalar_type(), group.size());
    if (average.backend_average) {
      options.reduceOp = c10d::ReduceOp::AVG;
    } else {
      pre = average.pre;
      post = [tensor, after = average.post] { tensor.div_(after); };
    }
  }
  return launch(group, std::move(info), [&group, tensor, options, pre] {
    if (pre > 1) tensor.div_(pre);  // on the stream, before the collective
    std::vector<at::Tensor> tensors{tensor};
    return group.process_group().allreduce(tensors, options);
  }, std::move(post));
}

}  // namespace hp::dist::detail
