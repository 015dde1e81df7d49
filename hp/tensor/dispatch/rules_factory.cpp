// Factories that take a DTensor as a template. *_like ops keep the
// template's layout (a Partial dim becomes Replicate: ones_like of a Partial
// would otherwise sum to n). new_* ops with the template's global size do
// the same; any other size makes a Replicate tensor of that size.
#include <c10/util/strides.h>

#include "hp/tensor/dispatch/rule_util.h"

namespace hp::dispatch {

namespace {

OpPlan like_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  OpPlan plan;
  plan.inputs = call.input_layouts();
  plan.outputs.push_back({self.layout.without_partial(), self.shape});
  return plan;
}

// new_empty(self, size, ...), new_zeros, new_ones, new_full(self, size, fill),
// new_empty_strided(self, size, stride, ...): arg 1 is the global size.
OpPlan new_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  const Shape size = call.ints_arg(1);
  Layout out = size == self.shape ? self.layout.without_partial() : Layout::replicated(call.mesh());
  const Shape local = out.local_shape(size);
  OpPlan plan;
  plan.inputs = call.input_layouts();
  plan.outputs.push_back({out, size});
  call.arg(1) = c10::IValue(local);
  if (call.name() == "aten::new_empty_strided") {
    call.arg(2) = c10::IValue(c10::IntArrayRef(c10::contiguous_strides(local)).vec());
  }
  return plan;
}

}  // namespace

void register_factory_rules() {
  for (const char* op : {"aten::empty_like", "aten::zeros_like", "aten::ones_like",
                         "aten::full_like", "aten::rand_like", "aten::randn_like"}) {
    register_rule(op, like_rule, true);
  }
  for (const char* op : {"aten::new_empty", "aten::new_zeros", "aten::new_ones", "aten::new_full",
                         "aten::new_empty_strided"}) {
    register_rule(op, new_rule, true);
  }
}

}  // namespace hp::dispatch
