// Small helpers the sharding rules share.
#pragma once

#include <cstdint>
#include <vector>

#include "hp/tensor/dispatch/sharding_rule.h"

namespace hp::dispatch {

inline int64_t wrap_dim(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

Layout make_layout(const DeviceMeshPtr& mesh, Placements placements);
Layout replicated(const DeviceMeshPtr& mesh);
// `layout` with every Partial placement replaced by Replicate.
Layout without_partial(const Layout& layout);
// `layout` with every placement that shards `tensor_dim` replaced by Replicate.
Layout unshard_dim(const Layout& layout, int64_t tensor_dim);

// The local shape of a tensor of global `shape` laid out as `layout` on
// this rank, and its offset.
Shape local_shape_of(const Shape& shape, const Layout& layout);
Shape local_offset_of(const Shape& shape, const Layout& layout);

// Broadcast shape of several shapes (numpy rules).
Shape broadcast_shapes(const std::vector<Shape>& shapes);

// Contiguous strides for `sizes`.
std::vector<int64_t> contiguous_strides(const Shape& sizes);

// How a pointwise op treats Partial inputs.
enum class PartialRule {
  kNone,            // nonlinear: Partial inputs are reduced first
  kLinear,          // add/sub: all Partial (same op) stay Partial
  kMultiplicative,  // mul/div: one Partial operand times Replicate ones stays Partial
  kPreserving,      // unary linear (neg, clone, mul by scalar): Partial stays Partial
};

// Plans a broadcasting pointwise op over `tensor_inputs` (indices into
// call.inputs()). `inplace` is the index of the input written in place, or
// -1. `extra_shaped` are inputs that do not take part in broadcasting but
// must be Replicate (e.g. a weight of another shape). Returns the plan with
// one output spec of the broadcast shape (plus `extra_outputs` copies).
OpPlan plan_pointwise(OpCall& call, PartialRule partial, int64_t inplace = -1,
                      size_t num_outputs = 1);

// Every input Replicate, outputs Replicate with the given shapes.
OpPlan plan_replicated(OpCall& call, const std::vector<Shape>& output_shapes);

// Pops the op's arguments and pushes `outputs`.
void replace_args_with(torch::jit::Stack& stack, size_t num_args, std::vector<c10::IValue> outputs);

}  // namespace hp::dispatch
