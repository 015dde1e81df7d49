#include "hp/tensor/dispatch/rule_util.h"

#include <ATen/ExpandUtils.h>

#include <algorithm>

#include "hp/util/error.h"

namespace hp::dispatch {

Shape broadcast_shape(const OpCall& call, const std::vector<Shape>& shapes) {
  Shape out;
  for (const auto& s : shapes) {
    out = checked_by_torch(call, [&] { return at::infer_size(out, s); });
  }
  return out;
}

OpPlan plan_pointwise(OpCall& call, PartialRule partial, int64_t inplace, size_t num_outputs) {
  const auto& ins = call.inputs();
  const auto& mesh = call.mesh();
  // The common case first: DTensors of one layout and shape, nothing
  // Partial. The output is laid out alike; nothing moves.
  bool alike = !ins.empty();
  for (const auto& in : ins) {
    alike = alike && !in.plain && in.shape == ins[0].shape && in.layout == ins[0].layout;
  }
  if (alike) {
    for (const auto& p : ins[0].layout.placements()) alike = alike && !p.is_partial();
  }
  if (alike) {
    OpPlan plan;
    plan.inputs.assign(ins.size(), ins[0].layout);
    plan.outputs.assign(num_outputs, OutputSpec{ins[0].layout, ins[0].shape});
    return plan;
  }
  std::vector<Shape> shapes;
  for (const auto& in : ins) shapes.push_back(in.shape);
  const Shape out_shape = inplace >= 0 ? ins[inplace].shape : broadcast_shape(call, shapes);
  const int64_t out_nd = static_cast<int64_t>(out_shape.size());

  // Whether input k's dim d is broadcast (size 1 against a larger output).
  auto broadcast_dim = [&](size_t k, int64_t d) {
    const int64_t od = d + out_nd - static_cast<int64_t>(ins[k].shape.size());
    return ins[k].shape[d] == 1 && out_shape[od] != 1;
  };

  Placements out(mesh->ndim(), Replicate());
  std::vector<Placements> need(ins.size(), Placements(mesh->ndim(), Replicate()));
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    // 1. The output placement on this mesh dim.
    std::optional<Placement> target;
    if (inplace >= 0) {
      target = ins[inplace].layout.placements()[m];
      if (target->is_sharded()) {
        target = target->with_dim(target->dim() + out_nd -
                                  static_cast<int64_t>(ins[inplace].shape.size()));
      }
    } else {
      for (size_t k = 0; k < ins.size() && !target; ++k) {
        const Placement& p = ins[k].layout.placements()[m];
        if (p.is_sharded() && !broadcast_dim(k, p.dim())) {
          target = p.with_dim(p.dim() + out_nd - static_cast<int64_t>(ins[k].shape.size()));
        }
      }
      if (!target) {
        // Partial survives only where the op is linear in the Partial inputs.
        size_t partials = 0;
        std::optional<Placement> first_partial;
        bool same_op = true;
        for (const auto& in : ins) {
          const Placement& p = in.layout.placements()[m];
          if (!p.is_partial()) continue;
          if (first_partial && p != *first_partial) same_op = false;
          if (!first_partial) first_partial = p;
          ++partials;
        }
        const bool sum_like = first_partial && (first_partial->reduce_op() == dist::ReduceOp::kSum ||
                                                first_partial->reduce_op() == dist::ReduceOp::kAvg);
        if (partials > 0 && same_op && sum_like) {
          if ((partial == PartialRule::kLinear && partials == ins.size()) ||
              (partial == PartialRule::kMultiplicative && partials == 1 &&
               ins[0].layout.placements()[m].is_partial()) ||
              (partial == PartialRule::kPreserving && partials == ins.size())) {
            target = first_partial;
          }
          // mul: either operand may carry the Partial.
          if (partial == PartialRule::kMultiplicative && partials == 1 &&
              call.name() == "aten::mul") {
            target = first_partial;
          }
        }
      }
    }
    if (!target) target = Replicate();
    if (target->is_partial() && partial == PartialRule::kNone) {
      throw_unsupported(call, "it is not linear, so it cannot update a Partial tensor in place");
    }
    // The input that carries a Partial through a multiplicative op.
    std::optional<size_t> carrier;
    if (target->is_partial()) {
      for (size_t k = 0; k < ins.size() && !carrier; ++k) {
        if (ins[k].layout.placements()[m].is_partial()) carrier = k;
      }
      if (inplace >= 0) carrier = static_cast<size_t>(inplace);
    }
    out[m] = *target;
    // 2. What each input must be on this mesh dim.
    for (size_t k = 0; k < ins.size(); ++k) {
      const int64_t off = out_nd - static_cast<int64_t>(ins[k].shape.size());
      Placement& q = need[k][m];
      if (target->is_sharded()) {
        const int64_t d = target->dim() - off;
        q = (d < 0 || broadcast_dim(k, d)) ? Replicate() : target->with_dim(d);
      } else if (target->is_partial()) {
        q = (partial != PartialRule::kMultiplicative || carrier == k) ? *target : Replicate();
      } else {
        q = Replicate();
      }
    }
  }
  OpPlan plan;
  for (size_t k = 0; k < ins.size(); ++k) {
    const Layout wanted(mesh, need[k]);
    // Keep a multi-axis order the input already has when placements agree.
    plan.inputs.push_back(wanted.placements() == ins[k].layout.placements() ? ins[k].layout
                                                                            : wanted);
  }
  Layout out_layout(mesh, out);
  if (inplace >= 0) out_layout = ins[inplace].layout;
  for (size_t i = 0; i < num_outputs; ++i) plan.outputs.push_back({out_layout, out_shape});
  return plan;
}

OpPlan plan_replicated(OpCall& call, const std::vector<Shape>& output_shapes) {
  OpPlan plan;
  const Layout replicated = Layout::replicated(call.mesh());
  plan.inputs.assign(call.inputs().size(), replicated);
  for (const auto& s : output_shapes) plan.outputs.push_back({replicated, s});
  return plan;
}

void replace_args_with(torch::jit::Stack& stack, size_t num_args, std::vector<c10::IValue> outputs) {
  torch::jit::drop(stack, num_args);
  for (auto& v : outputs) stack.push_back(std::move(v));
}

}  // namespace hp::dispatch
