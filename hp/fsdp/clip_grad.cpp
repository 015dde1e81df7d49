#include "hp/fsdp/clip_grad.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "hp/dist/collectives.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/unit.h"
#include "hp/util/error.h"

namespace hp {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type) {
  const bool inf_norm = std::isinf(norm_type);
  HP_CHECK_ARG(inf_norm || norm_type == 2.0, "clip_grad_norm_: norm_type must be 2.0 or inf, got ",
               norm_type);
  HP_CHECK_ARG(max_norm >= 0 && std::isfinite(max_norm),
               "clip_grad_norm_: max_norm must be a finite non-negative number, got ", max_norm);
  // Per shard group (in first-seen order, the same on every rank), the
  // reduction of its shards' norms; replicated gradients stay local.
  std::vector<dist::GroupPtr> groups;
  std::vector<double> group_values;
  double local_value = 0;
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters) {
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    grads.push_back(grad);
    // The squared 2-norm accumulated in double without a double copy of
    // the gradient.
    double value = 0;
    if (inf_norm) {
      value = grad.abs().max().item<double>();
    } else {
      const double norm = at::linalg_vector_norm(grad, 2, c10::nullopt, false, at::kDouble)
                              .item<double>();
      value = norm * norm;
    }
    auto managed = fsdp::find_managed(p);
    if (!managed || !managed->param->sharded()) {
      local_value = inf_norm ? std::max(local_value, value) : local_value + value;
      continue;
    }
    dist::GroupPtr group = managed->unit->mesh().reduce_group;
    auto it = std::find(groups.begin(), groups.end(), group);
    if (it == groups.end()) {
      groups.push_back(group);
      group_values.push_back(value);
    } else {
      double& v = group_values[it - groups.begin()];
      v = inf_norm ? std::max(v, value) : v + value;
    }
  }
  double total = local_value;
  for (size_t i = 0; i < groups.size(); ++i) {
    at::Tensor t = at::full({1}, group_values[i], at::kDouble);
    dist::all_reduce(*groups[i], t, inf_norm ? dist::ReduceOp::kMax : dist::ReduceOp::kSum).wait();
    const double v = t.item<double>();
    total = inf_norm ? std::max(total, v) : total + v;
  }
  const double norm = inf_norm ? total : std::sqrt(total);
  const double coefficient = max_norm / (norm + 1e-6);
  if (coefficient < 1.0) {
    for (auto& g : grads) g.mul_(coefficient);
  }
  return norm;
}

}  // namespace hp
