#include "hp/distributed/collectives.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <ostream>
#include <utility>
#include <vector>

#include "hp/distributed/collective_checks.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/native_average.h"
#include "hp/distributed/shm_channel.h"
#include "hp/distributed/work_launch.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"
#include "hp/util/trace.h"

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

// Gloo 1.13 rejects bf16, bool and int16 ("Invalid scalar type"): move their
// bytes as a same-size type it knows (fp16 for bf16: gathers, broadcasts and
// all-to-alls only copy bytes, so this is bit-exact). Never reduce through it.
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

// Whether the backend gathers into one flat tensor: NCCL always, Gloo where
// this libtorch's can (CPU tensors). The fallback gathers into a list of
// views (for NCCL a flat temporary plus one copy per rank).
bool gathers_flat(const Group& group, const at::Tensor& t) {
  if (group.backend_type() == BackendType::kNccl) return true;
  return compat::gloo_has_flat_all_gather() && t.is_cpu();
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

// A collective's state, with its sequence number claimed and (under
// HP_CHECK_COLLECTIVES) the call compared across the group. `sizes` formats
// the arguments for a failure message; it runs only then.
// tensors (the facade's arguments are checked by then).
bool on_channel(const Group& group, const at::Tensor& a, const at::Tensor& b) {
  return group.shm_channel() != nullptr && ShmChannel::carries(a) && ShmChannel::carries(b);
}

// Queues `channel_op` on the group's shared-memory channel; `finish` is the

// c10d options for `group`: on NCCL the collective runs on the current
// stream with no c10d stash (detail::stream_ordered); Gloo keeps its own
// threads.
template <typename Options>
Options options_for(const Group& group, Options options = {}) {
  return group.backend_type() == BackendType::kNccl ? detail::stream_ordered(options) : options;
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
  if (on_channel(group, in, output)) {
    return detail::launch_on_channel(group, info_for(op, std::move(sizes), fp, in),
                             {ShmChannel::Kind::kAllGather, in, output}, nullptr);
  }
  if (gathers_flat(group, in)) {
    return detail::launch(group, info_for(op, std::move(sizes), fp, in), [&group, output, in] {
      at::Tensor flat_out = wire_view(output).view(-1);
      at::Tensor flat_in = wire_view(in).view(-1);
      return group.process_group()._allgather_base(flat_out, flat_in,
                                                   options_for<c10d::AllgatherOptions>(group));
    }, nullptr);
  }
  return detail::launch(group, info_for(op, std::move(sizes), fp, in), [&group, output, in, n] {
    at::Tensor flat_out = wire_view(output).view(-1);
    std::vector<std::vector<at::Tensor>> outputs(1);
    outputs[0].reserve(group.size());
    for (int r = 0; r < group.size(); ++r) outputs[0].push_back(flat_out.narrow(0, r * n, n));
    std::vector<at::Tensor> inputs{wire_view(in).view(-1)};
    return group.process_group().allgather(outputs, inputs,
                                           options_for<c10d::AllgatherOptions>(group));
  }, nullptr);
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
  if (group.shm_channel() != nullptr) {
    // The channel copies bytes: it takes contiguous CPU tensors only (the
    // strided outputs stay on Gloo, which copies into them).
    bool contiguous_cpu = true;
    for (const at::Tensor& t : inputs) contiguous_cpu = contiguous_cpu && ShmChannel::carries(t);
    for (const auto& row : outputs) {
      for (const at::Tensor& t : row) {
        contiguous_cpu = contiguous_cpu && ShmChannel::carries(t) && t.is_contiguous();
      }
    }
    if (contiguous_cpu) {
      ShmChannel::Op channel_op;
      channel_op.kind = ShmChannel::Kind::kAllGatherCoalesced;
      for (const at::Tensor& t : inputs) channel_op.inputs.push_back(t.contiguous());
      channel_op.outputs = outputs;
      return detail::launch_on_channel(group, info_for(op, std::move(sizes), fp, inputs[0]), std::move(channel_op), nullptr);
    }
  }
  if (group.backend_type() == BackendType::kNccl || inputs[0].is_cuda()) {
    // c10d's NCCL backend has no coalesced all-gather, nor Gloo's for CUDA
    // tensors: pack the inputs, gather once and unpack, which is what Gloo's
    // does inside for CPU tensors.
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
    return detail::launch(group, info_for(op, std::move(sizes), fp, inputs[0]), [&group, packed, gathered, numel] {
      std::vector<std::vector<at::Tensor>> out(1);
      for (int r = 0; r < group.size(); ++r) out[0].push_back(gathered.narrow(0, r * numel, numel));
      std::vector<at::Tensor> in{packed};
      return group.process_group().allgather(out, in, options_for<c10d::AllgatherOptions>(group));
    }, std::move(unpack));
  }
  return detail::launch(group, info_for(op, std::move(sizes), fp, inputs[0]), [&group, outputs, inputs] {
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
  const bool nccl = group.backend_type() == BackendType::kNccl;
  // Low-precision data travels as its own bits and is summed in fp32 here
  // (NCCL sums bf16 and fp16 natively, as FSDP2 does).
  const bool low = is_low_precision(in.scalar_type()) && !nccl;
  // Where the backend reduces into the output itself (the channel), an
  // average is its sum divided afterwards.
  std::function<void()> divide_for_average;
  if (op_kind == ReduceOp::kAvg) divide_for_average = [output, size] { output.div_(size); };
  if (nccl) {
    // One reduce-scatter into the output itself (no group-size receive
    // buffer). An average is NCCL's own, or for fp16 a sum between a
    // division before and one after (native_average.h).
    c10d::ReduceScatterOptions options = options_for<c10d::ReduceScatterOptions>(group);
    options.reduceOp = to_c10d(op_kind);
    std::function<void()> post;
    at::Tensor send = in;
    if (op_kind == ReduceOp::kAvg) {
      const NativeAverage average = native_average(in.scalar_type(), size);
      if (average.backend_average) {
        options.reduceOp = c10d::ReduceOp::AVG;
      } else {
        if (average.pre > 1) send = in / average.pre;
        post = [output, after = average.post] { output.div_(after); };
      }
    }
    return detail::launch(group, info_for(op, std::move(sizes), fp, in),
                          [&group, output, send, options] {
                            at::Tensor out = output.view(-1), flat_in = send.view(-1);
                            return group.process_group()._reduce_scatter_base(out, flat_in,
                                                                              options);
                          },
                          std::move(post));
  }
  if (!low && on_channel(group, in, output)) {
    // Straight into the output: no group-size receive buffer, no local sum.
    return detail::launch_on_channel(group, info_for(op, std::move(sizes), fp, in),
                             {ShmChannel::Kind::kReduceScatter, wire_view(in).view(-1),
                              wire_view(output).view(-1), op_kind},
                             std::move(divide_for_average));
  }
  at::Tensor send = wire_view(in).view(-1);
  at::Tensor recv;
  if (scratch.defined()) {
    HP_CHECK_ARG(scratch.is_contiguous() && scratch.scalar_type() == in.scalar_type() &&
                     scratch.numel() >= size * n,
                 op, ": scratch ", describe_tensor(scratch), " must be a contiguous ",
                 in.scalar_type(), " tensor of at least ", size * n, " elements");
    recv = wire_view(scratch).view(-1).narrow(0, 0, size * n);
  } else {
    recv = at::empty({size * n}, send.options());
  }
  auto finish = [output, recv, size, n, op_kind, low, dtype = in.scalar_type()] {
    at::Tensor chunks = (low ? recv.view(dtype).to(at::kFloat) : recv.view(dtype)).view({size, n});
    at::Tensor out = output.view(-1);
    at::Tensor reduced;
    switch (op_kind) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        reduced = low ? chunks.sum(0) : at::sum_out(out, chunks, {0});
        if (op_kind == ReduceOp::kAvg) reduced.div_(size);
        break;
      case ReduceOp::kMax: reduced = low ? chunks.amax(0) : at::amax_out(out, chunks, {0}); break;
      case ReduceOp::kMin: reduced = low ? chunks.amin(0) : at::amin_out(out, chunks, {0}); break;
    }
    if (low) out.copy_(reduced);
  };
  return detail::launch(group, info_for(op, std::move(sizes), fp, in), [&group, send, recv] {
    at::Tensor s = send, r = recv;
    std::vector<int64_t> equal_splits;
    return group.process_group().alltoall_base(r, s, equal_splits, equal_splits,
                                               options_for<c10d::AllToAllOptions>(group));
  }, std::move(finish));
}

bool reduce_scatter_uses_scratch(const Group& group, const at::Tensor& input) {
  if (group.size() == 1 || group.backend_type() == BackendType::kNccl) return false;
  return is_low_precision(input.scalar_type()) || !on_channel(group, input, input);
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
  const bool nccl = group.backend_type() == BackendType::kNccl;
  if (nccl) {
    // NCCL reduces bf16 and fp16 natively and averages itself (fp16: a sum
    // between two divisions, as in reduce_scatter).
    c10d::AllreduceOptions options = options_for<c10d::AllreduceOptions>(group);
    options.reduceOp = to_c10d(op_kind);
    std::function<void()> post;
    int pre = 1;
    if (op_kind == ReduceOp::kAvg) {
      const NativeAverage average = native_average(tensor.scalar_type(), size);
      if (average.backend_average) {
        options.reduceOp = c10d::ReduceOp::AVG;
      } else {
        pre = average.pre;
        post = [tensor, after = average.post] { tensor.div_(after); };
      }
    }
    return detail::launch(group, info_for(op, std::move(sizes), fp, tensor),
                          [&group, tensor, options, pre] {
                            if (pre > 1) tensor.div_(pre);
                            std::vector<at::Tensor> tensors{tensor};
                            return group.process_group().allreduce(tensors, options);
                          },
                          std::move(post));
  }
  // bf16 and fp16 are reduced (and averaged) in fp32 and copied back, as in
  // reduce_scatter; bool reduces as bytes.
  const bool low = is_low_precision(tensor.scalar_type());
  at::Tensor buffer = low ? tensor.to(at::kFloat) : wire_view(tensor);
  std::function<void()> finish;
  if (low || op_kind == ReduceOp::kAvg) {
    finish = [tensor, buffer, low, size, op_kind] {
      if (op_kind == ReduceOp::kAvg) buffer.div_(size);
      if (low) tensor.copy_(buffer);
    };
  }
  if (on_channel(group, buffer, buffer)) {
    return detail::launch_on_channel(group, info_for(op, std::move(sizes), fp, tensor),
                             {ShmChannel::Kind::kAllReduce, buffer.view(-1), {}, op_kind},
                             std::move(finish));
  }
  return detail::launch(group, info_for(op, std::move(sizes), fp, tensor), [&group, buffer, op_kind] {
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op_kind);
    return group.process_group().allreduce(tensors, options);
  }, std::move(finish));
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
  return detail::launch(group, info_for(op, std::move(sizes), fp, tensor), [&group, tensor, source] {
    std::vector<at::Tensor> tensors{wire_view(tensor)};
    c10d::BroadcastOptions options = options_for<c10d::BroadcastOptions>(group);
    options.rootRank = source;
    return group.process_group().broadcast(tensors, options);
  }, nullptr);
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
  return detail::launch(group, info_for(op, std::move(sizes), fp, in),
                [&group, output, in, output_splits, input_splits] {
                  at::Tensor o = wire_view(output), i = wire_view(in);
                  std::vector<int64_t> os = output_splits, is = input_splits;
                  return group.process_group().alltoall_base(o, i, os, is,
                                                             options_for<c10d::AllToAllOptions>(group));
                },
                nullptr);
}

Work barrier(Group& group) {
  constexpr const char* op = "barrier";
  check_member(group, op);
  CallFingerprint fp{OpType::kBarrier, 0, 0, 0, 0};
  auto sizes = [] { return std::string("no tensors"); };
  if (group.size() == 1) return detail::launch(group, info_for(op, std::move(sizes), fp, at::Tensor()), nullptr, nullptr);
  return detail::launch(group, info_for(op, std::move(sizes), fp, at::Tensor()),
                [&group] { return group.process_group().barrier(); },
                nullptr);
}

}  // namespace hp::dist
