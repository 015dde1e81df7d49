// Backward of select and slice: the gradient is scattered into zeros of the
// input's size. Both carry the input's GLOBAL sizes, which the rules rewrite
// into this rank's local sizes. The selected or sliced dim must be whole (its
// index, start and end are global), so a slice's gradient sharded on it is
// gathered first; select's dim is new in the result and unsharded. Every
// other shard, and Partial (the scatter is linear), carries over.
#include "hp/tensor/dispatch/rule_util.h"

namespace hp::dispatch {

namespace {

// select_backward(grad_output, input_sizes, dim, index)
OpPlan select_backward_rule(OpCall& call) {
  const OpInput& grad = call.input(0);
  const Shape sizes = call.ints_arg(1);
  const int64_t dim = wrap_dim(call.int_arg(2), static_cast<int64_t>(sizes.size()));
  ShardSpec spec;
  spec.placements = grad.layout.placements();
  for (auto& p : spec.placements) {
    if (p.is_shard() && p.dim() >= dim) p = Shard(p.dim() + 1);
  }
  for (const auto& [d, order] : grad.layout.spec().orders)
    spec.orders[d >= dim ? d + 1 : d] = order;
  spec.canonicalize();
  Layout out(call.mesh(), std::move(spec));
  OpPlan plan;
  plan.inputs = {grad.layout};
  plan.outputs.push_back({out, sizes});
  call.arg(1) = c10::IValue(out.local_shape(sizes));
  return plan;
}

// slice_backward(grad_output, input_sizes, dim, start, end, step)
OpPlan slice_backward_rule(OpCall& call) {
  const OpInput& grad = call.input(0);
  const Shape sizes = call.ints_arg(1);
  const int64_t dim = wrap_dim(call.int_arg(2), static_cast<int64_t>(sizes.size()));
  const Layout need = grad.layout.unshard_dim(dim);
  OpPlan plan;
  plan.inputs = {need};
  plan.outputs.push_back({need, sizes});
  call.arg(1) = c10::IValue(need.local_shape(sizes));
  return plan;
}

}  // namespace

void register_view_backward_rules() {
  register_rule("aten::select_backward", select_backward_rule);
  register_rule("aten::slice_backward", slice_backward_rule);
}

}  // namespace hp::dispatch
