#include "hp/tensor/dispatch/rule_util.h"

#include <algorithm>

#include "hp/util/error.h"

namespace hp::dispatch {

Layout make_layout(const DeviceMeshPtr& mesh, Placements placements) {
  return Layout(mesh, std::move(placements));
}

Layout replicated(const DeviceMeshPtr& mesh) {
  return Layout(mesh, Placements(mesh->ndim(), Replicate()));
}

Layout without_partial(const Layout& layout) {
  ShardSpec spec = layout.spec();
  bool changed = false;
  for (auto& p : spec.placements) {
    if (p.is_partial()) {
      p = Replicate();
      changed = true;
    }
  }
  return changed ? Layout(layout.mesh(), std::move(spec)) : layout;
}

Layout unshard_dim(const Layout& layout, int64_t tensor_dim) {
  ShardSpec spec = layout.spec();
  bool changed = false;
  for (auto& p : spec.placements) {
    if (p.is_sharded() && p.dim() == tensor_dim) {
      p = Replicate();
      changed = true;
    }
  }
  if (!changed) return layout;
  spec.orders.erase(tensor_dim);
  return Layout(layout.mesh(), std::move(spec));
}

Shape local_shape_of(const Shape& shape, const Layout& layout) {
  const auto& mesh = *layout.mesh();
  return local_shape(shape, layout.spec(), mesh.shape(), mesh.coordinate());
}

Shape local_offset_of(const Shape& shape, const Layout& layout) {
  const auto& mesh = *layout.mesh();
  return local_offset(shape, layout.spec(), mesh.shape(), mesh.coordinate());
}

Shape broadcast_shapes(const std::vector<Shape>& shapes) {
  size_t n = 0;
  for (const auto& s : shapes) n = std::max(n, s.size());
  Shape out(n, 1);
  for (const auto& s : shapes) {
    const size_t off = n - s.size();
    for (size_t i = 0; i < s.size(); ++i) {
      if (s[i] != 1) out[off + i] = s[i];
    }
  }
  return out;
}

std::vector<int64_t> contiguous_strides(const Shape& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 2; i >= 0; --i) {
    strides[i] = strides[i + 1] * std::max<int64_t>(sizes[i + 1], 1);
  }
  return strides;
}

OpPlan plan_pointwise(OpCall& call, PartialRule partial, int64_t inplace, size_t num_outputs) {
  const auto& ins = call.inputs();
  const auto& mesh = call.mesh();
  std::vector<Shape> shapes;
  for (const auto& in : ins) shapes.push_back(in.shape);
  const Shape out_shape = inplace >= 0 ? ins[inplace].shape : broadcast_shapes(shapes);
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
    Layout wanted = make_layout(mesh, need[k]);
    // Keep a multi-axis order the input already has when placements agree.
    plan.inputs.push_back(wanted.placements() == ins[k].layout.placements() ? ins[k].layout
                                                                            : wanted);
  }
  Layout out_layout = make_layout(mesh, out);
  if (inplace >= 0) out_layout = ins[inplace].layout;
  for (size_t i = 0; i < num_outputs; ++i) plan.outputs.push_back({out_layout, out_shape});
  return plan;
}

OpPlan plan_replicated(OpCall& call, const std::vector<Shape>& output_shapes) {
  OpPlan plan;
  for (size_t k = 0; k < call.inputs().size(); ++k) plan.inputs.push_back(replicated(call.mesh()));
  for (const auto& s : output_shapes) plan.outputs.push_back({replicated(call.mesh()), s});
  return plan;
}

void replace_args_with(torch::jit::Stack& stack, size_t num_args, std::vector<c10::IValue> outputs) {
  torch::jit::drop(stack, num_args);
  for (auto& v : outputs) stack.push_back(std::move(v));
}

}  // namespace hp::dispatch
