// Rules for the ops inside neural-network layers: embedding, layer norm,
// softmax and the negative log-likelihood loss, forward and backward.
//
// Two of them compute across shards instead of gathering:
//  - an embedding whose table is split by rows (vocabulary parallel) looks
//    up the ids it holds, zeroes the others, and returns a Partial sum;
//  - softmax / log_softmax over a sharded dim and the NLL loss over
//    class-sharded log-probabilities reduce the max, the exp-sum and the
//    picked values across the shards, so the loss of vocabulary-sharded
//    logits is computed without gathering them (loss parallel).
#include <ATen/ATen.h>
#include <ATen/core/Reduction.h>

#include <limits>

#include "hp/tensor/dispatch/rule_util.h"
#include "hp/tensor/redistribute_exec.h"
#include "hp/tensor/redistribute_plan.h"

namespace hp::dispatch {

namespace {

// Reduces `local` across the mesh dims in `mesh_dims` with `op` (the result
// is the same on all of them).
at::Tensor reduce_across(const at::Tensor& local, const DeviceMeshPtr& mesh,
                         const std::vector<int64_t>& mesh_dims, dist::ReduceOp op) {
  if (mesh_dims.empty()) return local;
  Placements from(mesh->ndim(), Replicate());
  for (int64_t m : mesh_dims) from[m] = Placement::partial(op);
  auto plan = plan_redistribute(Layout(mesh, from).spec(), Layout::replicated(mesh).spec());
  return execute_redistribute(*plan, local, *mesh, local.sizes().vec());
}

const OpInput* input_at(const OpCall& call, size_t arg) {
  for (const auto& in : const_cast<OpCall&>(call).inputs()) {
    if (in.arg == arg && in.element < 0) return &in;
  }
  return nullptr;
}

// ---- embedding -------------------------------------------------------------

// embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)
OpPlan embedding_rule(OpCall& call) {
  const OpInput& w = call.input(0);
  const OpInput& idx = call.input(1);
  const auto& mesh = call.mesh();
  const int64_t ni = static_cast<int64_t>(idx.shape.size());
  Placements pw(mesh->ndim(), Replicate()), pi = pw, po = pw;
  std::vector<int64_t> row_dims;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    const Placement& a = w.layout.placements()[m];
    const Placement& b = idx.layout.placements()[m];
    if (a.is_shard(0)) {
      pw[m] = a, pi[m] = Replicate(), po[m] = Partial();
      row_dims.push_back(m);
    } else if (a.is_shard(1)) {
      pw[m] = a, pi[m] = Replicate(), po[m] = Shard(ni);
    } else {
      pw[m] = Replicate();
      pi[m] = b.is_shard() ? b : Replicate();
      po[m] = pi[m];
    }
  }
  OpPlan plan;
  plan.inputs = {Layout(mesh, pw), Layout(mesh, pi)};
  if (plan.inputs[0].placements() == w.layout.placements()) plan.inputs[0] = w.layout;
  Shape out = idx.shape;
  out.push_back(w.shape[1]);
  Layout out_layout(mesh, po);
  plan.outputs.push_back({out_layout, out});
  if (!row_dims.empty()) {
    const Shape offset = plan.inputs[0].local_offset(w.shape);
    const Shape rows = plan.inputs[0].local_shape(w.shape);
    plan.kernel = [lo = offset[0], n = rows[0]](torch::jit::Stack& stack) {
      at::Tensor weight = stack[stack.size() - 5].toTensor();
      at::Tensor ids = stack[stack.size() - 4].toTensor();
      at::Tensor outside = (ids < lo).logical_or_(ids >= lo + n);
      at::Tensor local_ids = (ids - lo).masked_fill_(outside, 0);
      at::Tensor result = n > 0 ? at::embedding(weight, local_ids)
                                : at::zeros(ids.sizes().vec(), weight.options())
                                      .unsqueeze(-1)
                                      .expand({-1, weight.size(1)});
      if (n > 0) result.masked_fill_(outside.unsqueeze(-1), 0);
      replace_args_with(stack, 5, {n > 0 ? result : result.contiguous()});
    };
  }
  return plan;
}

// embedding_dense_backward(grad_output, indices, num_weights, padding_idx,
// scale_grad_by_freq): the table's gradient, Partial where the rows of
// grad_output are spread over ranks.
OpPlan embedding_backward_rule(OpCall& call) {
  const OpInput& g = call.input(0);
  const auto& mesh = call.mesh();
  const int64_t ng = static_cast<int64_t>(g.shape.size());
  Placements pg(mesh->ndim(), Replicate()), pi = pg, po = pg;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    const Placement& a = g.layout.placements()[m];
    if (a.is_shard(ng - 1)) {
      pg[m] = a, pi[m] = Replicate(), po[m] = Shard(1);
    } else if (a.is_shard()) {
      pg[m] = a, pi[m] = a, po[m] = Partial();
    } else if (a.is_partial()) {
      pg[m] = a, pi[m] = Replicate(), po[m] = a;
    } else {
      pg[m] = pi[m] = po[m] = Replicate();
    }
  }
  OpPlan plan;
  plan.inputs = {Layout(mesh, pg), Layout(mesh, pi)};
  plan.outputs.push_back({Layout(mesh, po), {call.int_arg(2), g.shape[ng - 1]}});
  return plan;
}

// ---- layer norm --------------------------------------------------------------

// native_layer_norm(input, normalized_shape, weight?, bias?, eps)
//   -> (out, mean, rstd)
OpPlan layer_norm_rule(OpCall& call) {
  const OpInput& x = call.input(0);
  const int64_t nd = static_cast<int64_t>(x.shape.size());
  const int64_t axis = nd - static_cast<int64_t>(call.ints_arg(1).size());
  Layout need = x.layout.without_partial();
  for (int64_t d = axis; d < nd; ++d) need = need.unshard_dim(d);
  OpPlan plan;
  plan.inputs = call.input_layouts();
  plan.inputs[0] = need;
  for (size_t k = 1; k < plan.inputs.size(); ++k) plan.inputs[k] = Layout::replicated(call.mesh());
  Shape stat = x.shape;
  for (int64_t d = axis; d < nd; ++d) stat[d] = 1;
  plan.outputs = {{need, x.shape}, {need, stat}, {need, stat}};
  return plan;
}

// native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd,
// weight?, bias?, output_mask) -> (grad_input, grad_weight, grad_bias).
// Rows sharded: the weight's gradients are Partial sums over the rows.
OpPlan layer_norm_backward_rule(OpCall& call) {
  const OpInput* x = input_at(call, 1);
  const auto& mesh = call.mesh();
  const int64_t nd = static_cast<int64_t>(x->shape.size());
  const int64_t axis = nd - static_cast<int64_t>(call.ints_arg(2).size());
  Placements px(mesh->ndim(), Replicate()), pg = px, pin = px, pw = px;
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    const Placement& a = x->layout.placements()[m];
    if (a.is_shard() && a.dim() < axis) {
      px[m] = pg[m] = pin[m] = a;
      pw[m] = Partial();
    } else {
      // A Partial grad_out (the input gradient of a column-parallel layer
      // after this norm) is reduced here, once: the input gradient then joins
      // the residual stream's Replicate gradient with no further reduction,
      // and the weight and bias gradients come out whole (Megatron's single
      // all-reduce before the norm's backward).
      px[m] = pg[m] = pin[m] = pw[m] = Replicate();
    }
  }
  OpPlan plan;
  plan.inputs = call.input_layouts();
  for (size_t k = 0; k < plan.inputs.size(); ++k) {
    const size_t arg = call.inputs()[k].arg;
    plan.inputs[k] = arg == 0 ? Layout(mesh, pg)
                     : (arg == 1 || arg == 3 || arg == 4) ? Layout(mesh, px)
                                                          : Layout::replicated(mesh);
  }
  const OpInput* w = input_at(call, 5);
  Shape wshape = w ? w->shape : Shape(x->shape.begin() + axis, x->shape.end());
  plan.outputs = {{Layout(mesh, pin), x->shape},
                  {Layout(mesh, pw), wshape},
                  {Layout(mesh, pw), wshape}};
  return plan;
}

// ---- softmax -------------------------------------------------------------------

// What softmax and its backward share: `num_inputs` inputs laid out like
// input `like` without Partial, the output alike, and the mesh dims that
// shard the softmax dim (arg `dim_arg`), across which the kernel reduces.
struct SoftmaxPlan {
  OpPlan plan;
  int64_t dim;
  std::vector<int64_t> across;
};

SoftmaxPlan plan_softmax(OpCall& call, size_t like, size_t dim_arg, size_t num_inputs) {
  const OpInput& x = call.input(like);
  const int64_t dim = wrap_dim(call.int_arg(dim_arg), static_cast<int64_t>(x.shape.size()));
  const Layout need = x.layout.without_partial();
  SoftmaxPlan s{OpPlan{}, dim, need.mesh_dims_of(dim)};
  s.plan.inputs.assign(num_inputs, need);
  s.plan.outputs.push_back({need, x.shape});
  return s;
}

// _softmax / _log_softmax(self, dim, half_to_float)
OpPlan softmax_rule(OpCall& call) {
  SoftmaxPlan s = plan_softmax(call, 0, 1, 1);
  if (!s.across.empty()) {
    const bool log = call.name() == "aten::_log_softmax";
    s.plan.kernel = [dim = s.dim, across = s.across, log,
                     mesh = call.mesh()](torch::jit::Stack& stack) {
      at::Tensor self = stack[stack.size() - 3].toTensor();
      // A rank whose shard of `dim` is empty (uneven shards) still joins the
      // max: it contributes -inf, which max() refuses to compute for it.
      at::Tensor local_max;
      if (self.size(dim) > 0) {
        local_max = std::get<0>(self.max(dim, true));
      } else {
        std::vector<int64_t> shape = self.sizes().vec();
        shape[dim] = 1;
        local_max = at::full(shape, -std::numeric_limits<double>::infinity(), self.options());
      }
      at::Tensor shifted = self - reduce_across(local_max, mesh, across, dist::ReduceOp::kMax);
      at::Tensor sum = reduce_across(shifted.exp().sum(dim, true), mesh, across,
                                     dist::ReduceOp::kSum);
      replace_args_with(stack, 3, {log ? shifted - sum.log() : shifted.exp() / sum});
    };
  }
  return s.plan;
}

// _softmax_backward_data / _log_softmax_backward_data(grad, output, dim, dtype)
OpPlan softmax_backward_rule(OpCall& call) {
  SoftmaxPlan s = plan_softmax(call, 1, 2, 2);
  if (!s.across.empty()) {
    const bool log = call.name() == "aten::_log_softmax_backward_data";
    s.plan.kernel = [dim = s.dim, across = s.across, log,
                     mesh = call.mesh()](torch::jit::Stack& stack) {
      at::Tensor grad = stack[stack.size() - 4].toTensor();
      at::Tensor output = stack[stack.size() - 3].toTensor();
      at::Tensor result;
      if (log) {
        at::Tensor total = reduce_across(grad.sum(dim, true), mesh, across, dist::ReduceOp::kSum);
        result = grad - output.exp() * total;
      } else {
        at::Tensor gy = grad * output;
        at::Tensor total = reduce_across(gy.sum(dim, true), mesh, across, dist::ReduceOp::kSum);
        result = gy - output * total;
      }
      replace_args_with(stack, 4, {result});
    };
  }
  return s.plan;
}

// ---- negative log-likelihood -------------------------------------------------

struct NllGeometry {
  Layout self, target;
  std::vector<int64_t> class_dims, batch_dims;  // mesh dims
};

// self [N, C] sharded by classes (target Replicate) or by rows (target
// sharded alike); anything else is made Replicate.
NllGeometry nll_geometry(const OpCall& call, const OpInput& self) {
  const auto& mesh = call.mesh();
  if (self.shape.size() != 2) {
    return {Layout::replicated(mesh), Layout::replicated(mesh), {}, {}};
  }
  NllGeometry g;
  Placements ps(mesh->ndim(), Replicate()), pt(mesh->ndim(), Replicate());
  for (int64_t m = 0; m < mesh->ndim(); ++m) {
    const Placement& a = self.layout.placements()[m];
    if (a.is_shard(1)) {
      ps[m] = a;
      g.class_dims.push_back(m);
    } else if (a.is_shard(0)) {
      ps[m] = a;
      pt[m] = Shard(0);
      g.batch_dims.push_back(m);
    }
  }
  g.self = Layout(mesh, ps);
  g.target = Layout(mesh, pt);
  return g;
}

// Picks self[i, target[i]] where this rank holds that class; returns
// (picked values, mask of rows whose class this rank holds, valid rows).
struct Picked {
  at::Tensor values, held, valid;
};

Picked pick(const at::Tensor& self, const at::Tensor& target, int64_t class_offset,
            int64_t ignore_index) {
  const int64_t c = self.size(1);
  at::Tensor valid = target != ignore_index;
  at::Tensor held = valid.logical_and((target >= class_offset).logical_and_(target < class_offset + c));
  at::Tensor column = (target - class_offset).clamp_(0, std::max<int64_t>(c - 1, 0));
  at::Tensor values = c > 0 ? self.gather(1, column.unsqueeze(1)).squeeze(1)
                            : at::zeros({self.size(0)}, self.options());
  return {values.masked_fill(held.logical_not(), 0), held, valid};
}

// nll_loss_forward(self, target, weight?, reduction, ignore_index)
//   -> (output, total_weight)
OpPlan nll_loss_rule(OpCall& call) {
  const OpInput& self = call.input(0);
  if (input_at(call, 2)) throw_unsupported(call, "class weights are not supported on DTensors");
  NllGeometry g = nll_geometry(call, self);
  const int64_t reduction = call.int_arg(3);
  const auto& mesh = call.mesh();
  OpPlan plan;
  plan.inputs = {g.self, g.target};
  Placements po(mesh->ndim(), Replicate());
  for (int64_t m : g.class_dims) po[m] = Partial();
  if (reduction == at::Reduction::None) {
    for (int64_t m : g.batch_dims) po[m] = Shard(0);
    plan.outputs.push_back({Layout(mesh, po), {self.shape[0]}});
  } else {
    for (int64_t m : g.batch_dims) po[m] = Partial();
    plan.outputs.push_back({Layout(mesh, po), {}});
  }
  plan.outputs.push_back({Layout::replicated(mesh), {}});
  const int64_t class_offset = self.shape.size() == 2 ? g.self.local_offset(self.shape)[1] : 0;
  plan.kernel = [reduction, class_offset, mesh, batch = g.batch_dims](torch::jit::Stack& stack) {
    at::Tensor x = stack[stack.size() - 5].toTensor();
    at::Tensor t = stack[stack.size() - 4].toTensor();
    const int64_t ignore = stack[stack.size() - 1].toInt();
    if (x.dim() != 2) {
      auto out = at::nll_loss_forward(x, t, {}, reduction, ignore);
      replace_args_with(stack, 5, {std::get<0>(out), std::get<1>(out)});
      return;
    }
    Picked p = pick(x, t, class_offset, ignore);
    at::Tensor count = reduce_across(p.valid.sum().to(x.scalar_type()), mesh, batch,
                                     dist::ReduceOp::kSum);
    at::Tensor loss = p.values.neg();
    if (reduction == at::Reduction::Sum) loss = loss.sum();
    if (reduction == at::Reduction::Mean) loss = loss.sum() / count;
    replace_args_with(stack, 5, {loss, count});
  };
  return plan;
}

// nll_loss_backward(grad_output, self, target, weight?, reduction,
// ignore_index, total_weight) -> grad_input (laid out like self)
OpPlan nll_loss_backward_rule(OpCall& call) {
  const OpInput* self = input_at(call, 1);
  if (input_at(call, 3)) throw_unsupported(call, "class weights are not supported on DTensors");
  NllGeometry g = nll_geometry(call, *self);
  const int64_t reduction = call.int_arg(4);
  const auto& mesh = call.mesh();
  OpPlan plan;
  plan.inputs = call.input_layouts();
  for (size_t k = 0; k < plan.inputs.size(); ++k) {
    const size_t arg = call.inputs()[k].arg;
    if (arg == 1) plan.inputs[k] = g.self;
    else if (arg == 2) plan.inputs[k] = g.target;
    else if (arg == 0 && reduction == at::Reduction::None) {
      Placements pg(mesh->ndim(), Replicate());
      for (int64_t m : g.batch_dims) pg[m] = Shard(0);
      plan.inputs[k] = Layout(mesh, pg);
    } else {
      plan.inputs[k] = Layout::replicated(mesh);
    }
  }
  plan.outputs.push_back({g.self, self->shape});
  const int64_t class_offset =
      self->shape.size() == 2 ? g.self.local_offset(self->shape)[1] : 0;
  plan.kernel = [reduction, class_offset](torch::jit::Stack& stack) {
    at::Tensor grad = stack[stack.size() - 7].toTensor();
    at::Tensor x = stack[stack.size() - 6].toTensor();
    at::Tensor t = stack[stack.size() - 5].toTensor();
    const int64_t ignore = stack[stack.size() - 2].toInt();
    at::Tensor total = stack[stack.size() - 1].toTensor();
    if (x.dim() != 2) {
      at::Tensor r = at::nll_loss_backward(grad, x, t, {}, reduction, ignore, total);
      replace_args_with(stack, 7, {r});
      return;
    }
    Picked p = pick(x, t, class_offset, ignore);
    at::Tensor scale = reduction == at::Reduction::Mean ? grad / total : grad;
    at::Tensor rows = (reduction == at::Reduction::None ? scale : scale.expand({x.size(0)})).neg();
    rows = rows.masked_fill(p.held.logical_not(), 0);
    at::Tensor result = at::zeros_like(x);
    if (x.size(1) > 0) {
      at::Tensor column = (t - class_offset).clamp_(0, x.size(1) - 1);
      result.scatter_(1, column.unsqueeze(1), rows.unsqueeze(1).to(x.scalar_type()));
    }
    replace_args_with(stack, 7, {result});
  };
  return plan;
}

}  // namespace

void register_nn_rules() {
  register_rule("aten::embedding", embedding_rule);
  register_rule("aten::embedding_dense_backward", embedding_backward_rule);
  register_rule("aten::native_layer_norm", layer_norm_rule);
  register_rule("aten::native_layer_norm_backward", layer_norm_backward_rule);
  register_rule("aten::_softmax", softmax_rule);
  register_rule("aten::_log_softmax", softmax_rule);
  register_rule("aten::_softmax_backward_data", softmax_backward_rule);
  register_rule("aten::_log_softmax_backward_data", softmax_backward_rule);
  register_rule("aten::nll_loss_forward", nll_loss_rule);
  register_rule("aten::nll_loss_backward", nll_loss_backward_rule);
}

}  // namespace hp::dispatch
