// The collectives facade: asynchronous collectives on a Group, over the
// flat, contiguous buffers that the layers above pack.
//
// Every function validates its arguments locally and raises ArgumentError
// before anything reaches the wire (a peer must never hang because one rank
// rejected its input). Sizes that differ across ranks cannot be seen locally;
// set HP_CHECK_COLLECTIVES=1 to have every collective first compare
// (op, sequence number, sizes, dtype) across the group, which turns a
// mismatch into a CollectiveError on every rank instead of a backend abort.
//
// dtypes: Gloo 1.13 cannot move bf16 or bool; the facade moves them as
// same-size integers (bit-exact) and reduces bf16/fp16 in fp32.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/group.h"
#include "hp/distributed/reduce_op.h"
#include "hp/distributed/work.h"

namespace hp::dist {

// output[i*n:(i+1)*n] = input of group rank i, n = input.numel().
// output must be contiguous with group.size() * n elements of input's dtype;
// the group ranks' pieces land in it directly (one flat gather on NCCL and on
// 2.15's Gloo, a list of views of it on 1.13's; no reshaping copy after).
Work all_gather_into(Group& group, const at::Tensor& output, const at::Tensor& input);

// One all-gather of several tensors: outputs[r][i] receives inputs[i] of
// group rank r. Every rank passes the same shapes; one dtype throughout.
// The outputs may be any views (strided too: the backend copies into them),
// so a caller can gather straight into where the data is used.
Work all_gather_coalesced(Group& group, const std::vector<std::vector<at::Tensor>>& outputs,
                          const std::vector<at::Tensor>& inputs);

// output = op over ranks of input[r*n:(r+1)*n] where r is this rank's group
// rank and n = output.numel(). On NCCL one reduce-scatter into output, in
// the input's dtype (bf16 and fp16 natively); an average is NCCL's own, for
// fp16 a sum between two divisions that keep it in range. Otherwise one
// all-to-all plus a local reduction (the same bytes on the wire as a ring
// reduce-scatter; Gloo 1.13 has none, and bf16 / fp16 are summed in fp32
// there), or the shared-memory channel's reduce-scatter for fp32. The
// all-to-all receives group.size() * n elements: pass `scratch`
// (contiguous, input's dtype, at least that many elements, not overlapping
// input) to receive into memory the caller has anyway instead of a new
// allocation; reduce_scatter_uses_scratch() says whether it will.
Work reduce_scatter(Group& group, const at::Tensor& output, const at::Tensor& input,
                    ReduceOp op = ReduceOp::kSum, const at::Tensor& scratch = {});

// Whether reduce_scatter(group, ..., input, ..., scratch) receives into
// `scratch` (the all-to-all path); elsewhere a lent scratch buffer is not
// touched and can be released at once.
bool reduce_scatter_uses_scratch(const Group& group, const at::Tensor& input);

// tensor = op over ranks of tensor, in place (NCCL: bf16 and fp16 natively).
Work all_reduce(Group& group, const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);

// tensor = tensor of group rank `source`, in place.
Work broadcast(Group& group, const at::Tensor& tensor, int source);

// Exchanges dim-0 slices: this rank sends input rows
// [sum(input_splits[:j]), +input_splits[j]) to group rank j and receives
// output_splits[j] rows from it, in group-rank order. Empty split vectors
// mean equal splits.
Work all_to_all(Group& group, const at::Tensor& output, const at::Tensor& input,
                const std::vector<int64_t>& output_splits = {},
                const std::vector<int64_t>& input_splits = {});

Work barrier(Group& group);

}  // namespace hp::dist
