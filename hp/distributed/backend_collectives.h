// The routes a checked collective takes to the wire, one concept per file.
// Internal to hp/distributed: collectives.cpp (the facade) validates the
// arguments, settles the empty and one-rank cases, builds the LaunchInfo and
// picks a route:
//   channel_collectives.cpp  the shared-memory channel (ranks of one host,
//                            contiguous CPU tensors);
//   nccl_collectives.cpp     NCCL's native calls, on the current stream,
//                            reducing bf16 and fp16 in their own dtype;
//   gloo_collectives.cpp     c10d's Gloo and what it lacks: bytes of dtypes it
//                            refuses moved as a same-size type, bf16 and fp16
//                            summed in fp32, a reduce-scatter built from an
//                            all-to-all;
//   c10d_collectives.cpp     the calls both c10d backends take alike
//                            (broadcast, all-to-all, barrier, the packed
//                            coalesced all-gather).
// Every function takes tensors the facade checked (contiguous where the
// facade requires it, the group's device and dtype rules) and returns the
// collective's Work; errors surface through it as CollectiveError.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "hp/distributed/group.h"
#include "hp/distributed/reduce_op.h"
#include "hp/distributed/work.h"
#include "hp/distributed/work_launch.h"

namespace hp::dist::detail {

// --- shared by the c10d routes ---
// c10d's op for `op` (an average is a sum the route divides, unless it uses
// the backend's own).
c10d::ReduceOp to_c10d(ReduceOp op);
// c10d options for `group`: on NCCL the collective runs on the current
// stream with no c10d stash (stream_ordered); Gloo keeps its own threads.
template <typename Options>
Options options_for(const Group& group, Options options = {}) {
  return group.backend_type() == BackendType::kNccl ? stream_ordered(options) : options;
}
// Gloo 1.13 refuses bf16, bool and int16 ("Invalid scalar type"): their bytes
// travel as a same-size type it knows (fp16 for bf16). Only for moves that
// copy bytes (gathers, broadcasts, all-to-alls), never for a reduction.
at::Tensor wire_view(const at::Tensor& t);
bool is_low_precision(at::ScalarType type);

// --- the shared-memory channel ---
bool on_channel(const Group& group, const at::Tensor& a, const at::Tensor& b);
Work channel_all_gather(Group& group, LaunchInfo info, const at::Tensor& output,
                        const at::Tensor& input);
// Only where every tensor is a contiguous CPU tensor the channel carries
// (channel_carries_all); the outputs receive the group ranks' inputs.
bool channel_carries_all(const Group& group, const std::vector<std::vector<at::Tensor>>& outputs,
                         const std::vector<at::Tensor>& inputs);
Work channel_all_gather_coalesced(Group& group, LaunchInfo info,
                                  const std::vector<std::vector<at::Tensor>>& outputs,
                                  const std::vector<at::Tensor>& inputs);
// Not for bf16 or fp16 (the channel sums in the dtype it is given).
Work channel_reduce_scatter(Group& group, LaunchInfo info, const at::Tensor& output,
                            const at::Tensor& input, ReduceOp op);

// --- NCCL ---
Work nccl_all_gather(Group& group, LaunchInfo info, const at::Tensor& output,
                     const at::Tensor& input);
Work nccl_reduce_scatter(Group& group, LaunchInfo info, const at::Tensor& output,
                         const at::Tensor& input, ReduceOp op);
Work nccl_all_reduce(Group& group, LaunchInfo info, const at::Tensor& tensor, ReduceOp op);

// --- Gloo (and the channel's all-reduce, which shares its fp32 sums) ---
Work gloo_all_gather(Group& group, LaunchInfo info, const at::Tensor& output,
                     const at::Tensor& input);
Work gloo_all_gather_coalesced(Group& group, LaunchInfo info,
                               const std::vector<std::vector<at::Tensor>>& outputs,
                               const std::vector<at::Tensor>& inputs);
// One all-to-all into `scratch` (or a new buffer) and a local reduction.
Work gloo_reduce_scatter(Group& group, LaunchInfo info, const at::Tensor& output,
                         const at::Tensor& input, ReduceOp op, const at::Tensor& scratch);
// On the channel where it carries the tensor, else on Gloo.
Work host_all_reduce(Group& group, LaunchInfo info, const at::Tensor& tensor, ReduceOp op);

// --- c10d, either backend ---
// Packs the inputs, gathers once and unpacks: c10d's NCCL has no coalesced
// all-gather, nor its Gloo one for CUDA tensors. `numel`: the inputs' total.
Work packed_all_gather_coalesced(Group& group, LaunchInfo info,
                                 const std::vector<std::vector<at::Tensor>>& outputs,
                                 const std::vector<at::Tensor>& inputs, int64_t numel);
Work c10d_broadcast(Group& group, LaunchInfo info, const at::Tensor& tensor, int source);
Work c10d_all_to_all(Group& group, LaunchInfo info, const at::Tensor& output,
                     const at::Tensor& input, const std::vector<int64_t>& output_splits,
                     const std::vector<int64_t>& input_splits);
Work c10d_barrier(Group& group, LaunchInfo info);

}  // namespace hp::dist::detail
