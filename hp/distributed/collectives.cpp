#include "hp/distributed/collectives.h"

#include <ATen/ATen.h>

#include <functional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "hp/distributed/backend_collectives.h"
#include "hp/distributed/collective_checks.h"
#include "hp/distributed/work_launch.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

// The facade: every argument checked here, before any route (one file per
// route: backend_collectives.h) sees it.
namespace hp::dist {

namespace {

// A tensor's sizes and dtype, kept for a failure message without keeping the
// tensor (and its memory) alive. Streams as "[2, 3] Float".
struct TensorDesc {
  explicit TensorDesc(const at::Tensor& t)
      : sizes(t.sizes().begin(), t.sizes().end()), dtype(t.scalar_type()) {}
  c10::DimVector sizes;  // inline up to 5 dims: no allocation
  at::ScalarType dtype;
};

std::ostream& operator<<(std::ostream& out, const TensorDesc& d) {
  return out << to_string(std::vector<int64_t>(d.sizes.begin(), d.sizes.end())) << " "
             << d.dtype;
}

std::string describe_tensor(const at::Tensor& t) { return cat(TensorDesc(t)); }

void check_member(const Group& group, const char* op) {
  HP_CHECK_ARG(group.is_member(), op, ": this process is not a member of ", group.describe());
}

// Gloo moves CPU tensors, and CUDA tensors on a CUDA build (through host
// copies); NCCL only CUDA tensors.
void check_defined(const Group& group, const at::Tensor& t, const char* op, const char* name) {
  HP_CHECK_ARG(t.defined(), op, ": ", name, " is an undefined tensor");
  if (group.backend_type() == BackendType::kNccl) {
    HP_CHECK_ARG(t.is_cuda(), op, ": ", name, " is on ", t.device(), " but ", group.describe(),
                 " is an NCCL group; expected a CUDA tensor");
  } else {
    HP_CHECK_ARG(t.is_cpu() || t.is_cuda(), op, ": ", name, " is on ", t.device(), " but ",
                 group.describe(), " is a Gloo group; expected a CPU or CUDA tensor");
  }
}

void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  HP_CHECK_ARG(t.is_contiguous(), op, ": ", name, " ", describe_tensor(t),
               " must be contiguous (the facade works on flat buffers)");
}

void check_reduce_dtype(const at::Tensor& t, ReduceOp op_kind, const char* op) {
  HP_CHECK_ARG(op_kind != ReduceOp::kAvg || at::isFloatingType(t.scalar_type()), op,
               ": reduce op 'avg' needs a floating-point tensor, got ", t.scalar_type());
  HP_CHECK_ARG(t.scalar_type() != at::kBool || op_kind == ReduceOp::kMax ||
                   op_kind == ReduceOp::kMin,
               op, ": a bool tensor reduces with 'max' (any) or 'min' (all), got '",
               to_string(op_kind), "'");
}

// The tensors' device, for the Work (the CPU for a barrier).
detail::LaunchInfo info_for(const char* op, std::function<std::string()> sizes, CallFingerprint fp,
                            const at::Tensor& tensor) {
  return {op, std::move(sizes), fp, tensor.defined() ? tensor.device() : c10::Device(c10::kCPU),
          tensor.defined() ? static_cast<int64_t>(tensor.nbytes()) : 0};
}

}  // namespace

Work all_gather_into(Group& group, const at::Tensor& output, const at::Tensor& input) {
  constexpr const char* op = "all_gather";
  check_member(group, op);
  check_defined(group, output, op, "output");
  check_defined(group, input, op, "input");
  check_contiguous(output, op, "output");
  HP_CHECK_ARG(output.scalar_type() == input.scalar_type(), op, ": output dtype ",
               output.scalar_type(), " differs from input dtype ", input.scalar_type());
  const int64_t n = input.numel();
  HP_CHECK_ARG(output.numel() == group.size() * n, op, ": output ", describe_tensor(output),
               " must have group size ", group.size(), " x input numel ", n, " = ",
               group.size() * n, " elements");
  at::Tensor in = input.contiguous();
  auto sizes = [i = TensorDesc(input), o = TensorDesc(output)] {
    return cat("input ", i, ", output ", o);
  };
  CallFingerprint fp{OpType::kAllGather, 0, n, output.numel(), int(input.scalar_type())};
  if (group.size() == 1 || n == 0) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, in), nullptr, [output, in] {
      if (output.data_ptr() != in.data_ptr()) output.view(-1).copy_(in.view(-1));
    });
  }
  detail::LaunchInfo info = info_for(op, std::move(sizes), fp, in);
  if (group.backend_type() == BackendType::kNccl) {
    return detail::nccl_all_gather(group, std::move(info), output, in);
  }
  if (detail::on_channel(group, in, output)) {
    return detail::channel_all_gather(group, std::move(info), output, in);
  }
  return detail::gloo_all_gather(group, std::move(info), output, in);
}

Work all_gather_coalesced(Group& group, const std::vector<std::vector<at::Tensor>>& outputs,
                          const std::vector<at::Tensor>& inputs) {
  constexpr const char* op = "all_gather_coalesced";
  check_member(group, op);
  HP_CHECK_ARG(!inputs.empty(), op, ": inputs must not be empty");
  HP_CHECK_ARG(static_cast<int>(outputs.size()) == group.size(), op, ": outputs has ",
               outputs.size(), " lists but the group has ", group.size(), " ranks");
  const at::ScalarType dtype = inputs[0].scalar_type();
  int64_t numel = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_defined(group, inputs[i], op, "input");
    HP_CHECK_ARG(inputs[i].scalar_type() == dtype, op, ": input ", i, " is ",
                 inputs[i].scalar_type(), " but input 0 is ", dtype, "; expected one dtype");
    numel += inputs[i].numel();
  }
  for (size_t r = 0; r < outputs.size(); ++r) {
    HP_CHECK_ARG(outputs[r].size() == inputs.size(), op, ": outputs[", r, "] has ",
                 outputs[r].size(), " tensors for ", inputs.size(), " inputs");
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_defined(group, outputs[r][i], op, "output");
      HP_CHECK_ARG(outputs[r][i].numel() == inputs[i].numel() &&
                       outputs[r][i].scalar_type() == dtype,
                   op, ": outputs[", r, "][", i, "] ", describe_tensor(outputs[r][i]),
                   " does not match input ", i, " ", describe_tensor(inputs[i]));
    }
  }
  auto sizes = [count = inputs.size(), numel, dtype] {
    return cat(count, " inputs of ", numel, " elements in all, ", dtype);
  };
  CallFingerprint fp{OpType::kAllGather, 0, numel, numel * group.size(), int(dtype)};
  const int me = group.rank();
  if (group.size() == 1 || numel == 0) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, inputs[0]), nullptr, [outputs, inputs, me] {
      for (size_t i = 0; i < inputs.size(); ++i) {
        if (!outputs[me][i].is_same(inputs[i])) outputs[me][i].view_as(inputs[i]).copy_(inputs[i]);
      }
    });
  }
  detail::LaunchInfo info = info_for(op, std::move(sizes), fp, inputs[0]);
  if (detail::channel_carries_all(group, outputs, inputs)) {
    return detail::channel_all_gather_coalesced(group, std::move(info), outputs, inputs);
  }
  if (group.backend_type() == BackendType::kNccl || inputs[0].is_cuda()) {
    return detail::packed_all_gather_coalesced(group, std::move(info), outputs, inputs, numel);
  }
  return detail::gloo_all_gather_coalesced(group, std::move(info), outputs, inputs);
}

Work reduce_scatter(Group& group, const at::Tensor& output, const at::Tensor& input,
                    ReduceOp op_kind, const at::Tensor& scratch) {
  constexpr const char* op = "reduce_scatter";
  check_member(group, op);
  check_defined(group, output, op, "output");
  check_defined(group, input, op, "input");
  check_contiguous(output, op, "output");
  check_reduce_dtype(input, op_kind, op);
  HP_CHECK_ARG(output.scalar_type() == input.scalar_type(), op, ": output dtype ",
               output.scalar_type(), " differs from input dtype ", input.scalar_type());
  const int64_t n = output.numel();
  const int size = group.size();
  HP_CHECK_ARG(input.numel() == size * n, op, ": input ", describe_tensor(input),
               " must have group size ", size, " x output numel ", n, " = ", size * n,
               " elements");
  at::Tensor in = input.contiguous();
  auto sizes = [i = TensorDesc(input), o = TensorDesc(output), op_kind] {
    return cat("input ", i, ", output ", o, ", op ", to_string(op_kind));
  };
  CallFingerprint fp{OpType::kReduceScatter, 0, in.numel(), n, int(input.scalar_type()),
                     int(op_kind)};
  if (size == 1 || n == 0) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, in), nullptr, [output, in] {
      if (output.data_ptr() != in.data_ptr()) output.view(-1).copy_(in.view(-1));
    });
  }
  detail::LaunchInfo info = info_for(op, std::move(sizes), fp, in);
  if (group.backend_type() == BackendType::kNccl) {
    return detail::nccl_reduce_scatter(group, std::move(info), output, in, op_kind);
  }
  if (!detail::is_low_precision(in.scalar_type()) && detail::on_channel(group, in, output)) {
    return detail::channel_reduce_scatter(group, std::move(info), output, in, op_kind);
  }
  if (scratch.defined()) {
    HP_CHECK_ARG(scratch.is_contiguous() && scratch.scalar_type() == in.scalar_type() &&
                     scratch.numel() >= size * n,
                 op, ": scratch ", describe_tensor(scratch), " must be a contiguous ",
                 in.scalar_type(), " tensor of at least ", size * n, " elements");
  }
  return detail::gloo_reduce_scatter(group, std::move(info), output, in, op_kind, scratch);
}

bool reduce_scatter_uses_scratch(const Group& group, const at::Tensor& input) {
  if (group.size() == 1 || group.backend_type() == BackendType::kNccl) return false;
  return detail::is_low_precision(input.scalar_type()) || !detail::on_channel(group, input, input);
}

Work all_reduce(Group& group, const at::Tensor& tensor, ReduceOp op_kind) {
  constexpr const char* op = "all_reduce";
  check_member(group, op);
  check_defined(group, tensor, op, "tensor");
  check_contiguous(tensor, op, "tensor");
  check_reduce_dtype(tensor, op_kind, op);
  auto sizes = [t = TensorDesc(tensor), op_kind] {
    return cat("tensor ", t, ", op ", to_string(op_kind));
  };
  CallFingerprint fp{OpType::kAllReduce, 0, tensor.numel(), tensor.numel(),
                     int(tensor.scalar_type()), int(op_kind)};
  const int size = group.size();
  if (size == 1 || tensor.numel() == 0) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, tensor), nullptr, nullptr);
  }
  detail::LaunchInfo info = info_for(op, std::move(sizes), fp, tensor);
  if (group.backend_type() == BackendType::kNccl) {
    return detail::nccl_all_reduce(group, std::move(info), tensor, op_kind);
  }
  return detail::host_all_reduce(group, std::move(info), tensor, op_kind);
}

Work broadcast(Group& group, const at::Tensor& tensor, int source) {
  constexpr const char* op = "broadcast";
  check_member(group, op);
  check_defined(group, tensor, op, "tensor");
  check_contiguous(tensor, op, "tensor");
  HP_CHECK_ARG(source >= 0 && source < group.size(), op, ": source ", source,
               " is not a group rank of ", group.describe(), "; expected 0 <= source < ",
               group.size());
  auto sizes = [t = TensorDesc(tensor), source] { return cat("tensor ", t, ", source ", source); };
  CallFingerprint fp{OpType::kBroadcast, 0, tensor.numel(), tensor.numel(),
                     int(tensor.scalar_type()), source};
  if (group.size() == 1 || tensor.numel() == 0) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, tensor), nullptr, nullptr);
  }
  return detail::c10d_broadcast(group, info_for(op, std::move(sizes), fp, tensor), tensor, source);
}

Work all_to_all(Group& group, const at::Tensor& output, const at::Tensor& input,
                const std::vector<int64_t>& output_splits,
                const std::vector<int64_t>& input_splits) {
  constexpr const char* op = "all_to_all";
  check_member(group, op);
  check_defined(group, output, op, "output");
  check_defined(group, input, op, "input");
  check_contiguous(output, op, "output");
  HP_CHECK_ARG(output.scalar_type() == input.scalar_type(), op, ": output dtype ",
               output.scalar_type(), " differs from input dtype ", input.scalar_type());
  HP_CHECK_ARG(output.dim() >= 1 && input.dim() >= 1, op,
               ": input and output need at least one dimension, got input ",
               describe_tensor(input), " and output ", describe_tensor(output));
  const int size = group.size();
  auto check_splits = [&](const std::vector<int64_t>& splits, const at::Tensor& t,
                          const char* name) {
    if (splits.empty()) {
      HP_CHECK_ARG(t.size(0) % size == 0, op, ": ", name, " ", describe_tensor(t),
                   " has dim 0 of ", t.size(0), " rows, not divisible by group size ", size,
                   "; pass explicit splits");
      return;
    }
    HP_CHECK_ARG(static_cast<int>(splits.size()) == size, op, ": ", name, "_splits ",
                 to_string(splits), " must have one entry per group rank (", size, ")");
    int64_t total = 0;
    for (int64_t s : splits) {
      HP_CHECK_ARG(s >= 0, op, ": ", name, "_splits ", to_string(splits),
                   " has a negative entry");
      total += s;
    }
    HP_CHECK_ARG(total == t.size(0), op, ": ", name, "_splits ", to_string(splits), " sum to ",
                 total, " but ", name, " has ", t.size(0), " rows");
  };
  check_splits(output_splits, output, "output");
  check_splits(input_splits, input, "input");
  // Equal splits on both sides send and receive the same 1/size of every
  // rank's rows, so the two must be the same size (a group of one would
  // otherwise broadcast input into a larger output without complaint).
  HP_CHECK_ARG(!output_splits.empty() || !input_splits.empty() || output.numel() == input.numel(),
               op, ": with equal splits output ", describe_tensor(output), " (", output.numel(),
               " elements) and input ", describe_tensor(input), " (", input.numel(),
               " elements) must have the same number of elements; pass explicit splits");
  HP_CHECK_ARG(output.numel() / std::max<int64_t>(output.size(0), 1) ==
                   input.numel() / std::max<int64_t>(input.size(0), 1),
               op, ": a row of output ", describe_tensor(output), " and of input ",
               describe_tensor(input), " must hold the same number of elements");
  at::Tensor in = input.contiguous();
  auto sizes = [i = TensorDesc(input), o = TensorDesc(output), input_splits, output_splits] {
    return cat("input ", i, " splits ", to_string(input_splits), ", output ", o, " splits ",
               to_string(output_splits));
  };
  CallFingerprint fp{OpType::kAllToAll, 0, in.numel(), output.numel(), int(in.scalar_type())};
  if (size == 1) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, in), nullptr, [output, in] {
      if (output.data_ptr() != in.data_ptr()) output.copy_(in);
    });
  }
  return detail::c10d_all_to_all(group, info_for(op, std::move(sizes), fp, in), output, in,
                                 output_splits, input_splits);
}

Work barrier(Group& group) {
  constexpr const char* op = "barrier";
  check_member(group, op);
  CallFingerprint fp{OpType::kBarrier, 0, 0, 0, 0};
  auto sizes = [] { return std::string("no tensors"); };
  if (group.size() == 1) return detail::launch(group, info_for(op, std::move(sizes), fp, at::Tensor()), nullptr, nullptr);
  return detail::c10d_barrier(group, info_for(op, std::move(sizes), fp, at::Tensor()));
}

}  // namespace hp::dist
