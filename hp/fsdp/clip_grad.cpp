#include "hp/fsdp/clip_grad.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "hp/dist/collectives.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/unit.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"

namespace hp {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type) {
  const bool inf_norm = std::isinf(norm_type);
  HP_CHECK_ARG(inf_norm || norm_type == 2.0, "clip_grad_norm_: norm_type must be 2.0 or inf, got ",
               norm_type);
  HP_CHECK_ARG(max_norm >= 0 && std::isfinite(max_norm),
               "clip_grad_norm_: max_norm must be a finite non-negative number, got ", max_norm);
  // Per list of groups a gradient is split over (in first-seen order, the
  // same on every rank), the reduction of its pieces' norms; replicated
  // gradients (identical on every rank) stay local and count once.
  std::vector<std::vector<dist::GroupPtr>> splits;
  std::vector<double> split_values;
  double local_value = 0;
  std::vector<at::Tensor> grads;
  auto combine = [inf_norm](double a, double b) { return inf_norm ? std::max(a, b) : a + b; };
  for (const auto& p : parameters) {
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    // A DTensor gradient (tensor parallelism, with or without fully_shard)
    // is measured on its local piece and reduced over the mesh dims that
    // split it; its layout already says where the fully_shard shard is. A
    // Partial one cannot be measured piecewise: its norm goes through the
    // DTensor ops, which reduce it first and return the same value
    // everywhere.
    const bool piecewise = is_dtensor(grad) && std::none_of(
        layout_of(grad).placements().begin(), layout_of(grad).placements().end(),
        [](const Placement& q) { return q.is_partial(); });
    const at::Tensor& measured = piecewise ? local_of(grad) : grad;
    // The squared 2-norm accumulated in double without a double copy of
    // the gradient.
    double value = 0;
    if (inf_norm) {
      value = measured.abs().max().item<double>();
    } else {
      const double norm = at::linalg_vector_norm(measured, 2, c10::nullopt, false, at::kDouble)
                              .item<double>();
      value = norm * norm;
    }
    std::vector<dist::GroupPtr> split;
    if (piecewise) {
      const Layout& layout = layout_of(grad);
      for (int64_t m = 0; m < layout.mesh()->ndim(); ++m) {
        if (layout.placements()[m].is_sharded()) split.push_back(layout.mesh()->group_ptr(m));
      }
    } else if (!is_dtensor(grad)) {
      auto managed = fsdp::find_managed(p);
      if (managed && managed->param->sharded()) split.push_back(managed->unit->mesh().reduce_group);
    }
    if (split.empty()) {
      local_value = combine(local_value, value);
      continue;
    }
    auto it = std::find(splits.begin(), splits.end(), split);
    if (it == splits.end()) {
      splits.push_back(split);
      split_values.push_back(value);
    } else {
      double& v = split_values[it - splits.begin()];
      v = combine(v, value);
    }
  }
  double total = local_value;
  for (size_t i = 0; i < splits.size(); ++i) {
    at::Tensor t = at::full({1}, split_values[i], at::kDouble);
    // Reducing over each dim's group in turn reaches every rank that holds
    // a piece (the pieces form a grid over those dims).
    for (const auto& group : splits[i]) {
      dist::all_reduce(*group, t, inf_norm ? dist::ReduceOp::kMax : dist::ReduceOp::kSum).wait();
    }
    total = combine(total, t.item<double>());
  }
  const double norm = inf_norm ? total : std::sqrt(total);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    for (auto& g : grads) g.mul_(coefficient);
  }
  return norm;
}

}  // namespace hp
