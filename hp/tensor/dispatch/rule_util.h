// Small helpers the sharding rules share.
#pragma once

#include <cstdint>
#include <vector>

#include <c10/util/Exception.h>

#include "hp/tensor/dispatch/sharding_rule.h"
#include "hp/util/error.h"

namespace hp::dispatch {

inline int64_t wrap_dim(int64_t dim, int64_t ndim) { return dim < 0 ? dim + ndim : dim; }

// Runs `check` (libtorch's own shape arithmetic, which raises c10::Error on
// bad sizes) and returns its result; a c10::Error becomes an ArgumentError
// naming `call` (its inputs' placements and global shapes).
template <typename Check>
auto checked_by_torch(const OpCall& call, Check&& check) -> decltype(check()) {
  try {
    return check();
  } catch (const c10::Error& e) {
    throw_argument_error(cat("DTensor: ", call.describe(), ": ", exception_message(e)));
  }
}

// The broadcast shape of `shapes` (torch's rules, at::infer_size); shapes
// that do not broadcast raise ArgumentError naming `call` (its inputs' shapes).
Shape broadcast_shape(const OpCall& call, const std::vector<Shape>& shapes);

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
