#include "hp/fsdp/clip_grad.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/unit.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"

namespace hp {

namespace {

// Gradients split over the same list of groups: their values are combined
// locally, then reduced over each group in turn.
struct Split {
  std::vector<dist::GroupPtr> groups;
  std::vector<at::Tensor> values;  // 0-d double, one per gradient
};

// `t` on `device`. Towards a GPU without blocking the host (the GPU's
// stream orders the copy before its use); towards the CPU blocking, since
// the host (a CPU kernel, Gloo) reads the result at once and an
// asynchronous device-to-host copy may not have landed yet.
at::Tensor moved_to(const at::Tensor& t, c10::Device device) {
  return t.to(device, /*non_blocking=*/!device.is_cpu());
}

// The 0-d combination of `values` on `device`: their sum, or for the inf
// norm their maximum. One stack and one reduction, whatever the count.
at::Tensor combine(const std::vector<at::Tensor>& values, c10::Device device, bool inf_norm) {
  std::vector<at::Tensor> moved;
  moved.reserve(values.size());
  for (const auto& v : values) moved.push_back(moved_to(v, device));
  at::Tensor all = at::stack(moved);
  return inf_norm ? all.max() : all.sum();
}

}  // namespace

at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type, const dist::GroupPtr& across) {
  const bool inf_norm = std::isinf(norm_type);
  HP_CHECK_ARG(inf_norm || norm_type == 2.0, "clip_grad_norm_: norm_type must be 2.0 or inf, got ",
               norm_type);
  HP_CHECK_ARG(max_norm >= 0 && std::isfinite(max_norm),
               "clip_grad_norm_: max_norm must be a finite non-negative number, got ", max_norm);
  at::NoGradGuard no_grad;
  // Per list of groups a gradient is split over (in first-seen order, the
  // same on every rank), its pieces' values; replicated gradients
  // (identical on every rank) stay local and count once.
  std::vector<Split> splits;
  std::vector<at::Tensor> local_values;
  std::vector<at::Tensor> scaled;  // what the coefficient multiplies, in place
  for (const auto& p : parameters) {
    const at::Tensor& grad = p.grad();
    if (!grad.defined()) continue;
    // A DTensor gradient (tensor parallelism, with or without fully_shard)
    // is measured on its local piece and reduced over the mesh dims that
    // split it; its layout already says where the fully_shard shard is. A
    // Partial one cannot be measured piecewise: its norm goes through the
    // DTensor ops, which reduce it first, and is then the same everywhere.
    const bool dtensor = is_dtensor(grad);
    const bool piecewise = dtensor && std::none_of(
        layout_of(grad).placements().begin(), layout_of(grad).placements().end(),
        [](const Placement& q) { return q.is_partial(); });
    const at::Tensor& measured = piecewise ? local_of(grad) : grad;
    scaled.push_back(dtensor ? local_of(grad) : grad);
    // Accumulated in double without a double copy of the gradient; kept on
    // the gradient's device (no host sync per parameter).
    at::Tensor value = inf_norm ? measured.abs().max()
                                : at::linalg_vector_norm(measured, 2, c10::nullopt, false,
                                                         at::kDouble);
    if (is_dtensor(value)) value = full_tensor(value);
    value = inf_norm ? value.to(at::kDouble) : value.square();
    std::vector<dist::GroupPtr> split;
    if (piecewise) {
      const Layout& layout = layout_of(grad);
      for (int64_t m = 0; m < layout.mesh()->ndim(); ++m) {
        if (layout.placements()[m].is_sharded()) split.push_back(layout.mesh()->group_ptr(m));
      }
    } else if (!dtensor) {
      auto managed = fsdp::find_managed(p);
      if (managed && managed->param->sharded()) split.push_back(managed->unit->mesh().reduce_group);
    }
    if (split.empty()) {
      local_values.push_back(std::move(value));
      continue;
    }
    auto it = std::find_if(splits.begin(), splits.end(),
                           [&](const Split& s) { return s.groups == split; });
    if (it == splits.end()) {
      splits.push_back({std::move(split), {}});
      it = splits.end() - 1;
    }
    it->values.push_back(std::move(value));
  }
  // A rank of `across` without gradients still joins its reduction.
  if (scaled.empty() && !across) return at::zeros({}, at::kDouble);

  // The norm is returned with the first gradient, as torch's
  // clip_grad_norm_ returns it; each reduction runs on its group's device
  // (a GPU for NCCL, whose tensors cannot be on the CPU; the host for Gloo,
  // also with CUDA gradients) and its result comes back here.
  const c10::Device device =
      scaled.empty() ? c10::Device(c10::DeviceType::CPU) : scaled[0].device();
  std::vector<at::Tensor> parts;
  if (!local_values.empty()) parts.push_back(combine(local_values, device, inf_norm));
  for (const Split& split : splits) {
    // Reducing over each dim's group in turn reaches every rank that holds
    // a piece (the pieces form a grid over those dims).
    at::Tensor t = combine(split.values, split.groups[0]->device(), inf_norm).reshape({1});
    for (const auto& group : split.groups) {
      t = moved_to(t, group->device());
      dist::all_reduce(*group, t, inf_norm ? dist::ReduceOp::kMax : dist::ReduceOp::kSum).wait();
    }
    parts.push_back(t.reshape({}));
  }
  at::Tensor total =
      parts.empty() ? at::zeros({}, at::TensorOptions(at::kDouble).device(device))
                    : combine(parts, device, inf_norm);
  if (across) {
    at::Tensor t = moved_to(total.reshape({1}), across->device());
    dist::all_reduce(*across, t, inf_norm ? dist::ReduceOp::kMax : dist::ReduceOp::kSum).wait();
    total = moved_to(t, device).reshape({});
  }
  at::Tensor norm = inf_norm ? total : total.sqrt();
  // min(1, max_norm / (norm + eps)): scaling by exactly 1 leaves a gradient
  // bit for bit as it was, so nothing needs deciding on the host.
  at::Tensor coefficient = (max_norm / (norm + 1e-6)).clamp_max(1.0);
  std::vector<at::Tensor> coefficient_on;  // one per device the gradients are on
  for (auto& g : scaled) {
    auto it = std::find_if(coefficient_on.begin(), coefficient_on.end(),
                           [&](const at::Tensor& c) { return c.device() == g.device(); });
    if (it == coefficient_on.end()) {
      coefficient_on.push_back(moved_to(coefficient, g.device()));
      it = coefficient_on.end() - 1;
    }
    g.mul_(*it);
  }
  return norm;
}

}  // namespace hp
