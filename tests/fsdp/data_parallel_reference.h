// The single-process reference of a data-parallel step and the bounds a
// sharded run is held to against it.
//
// The reference processes the global batch as the ranks' slices, one after
// the other, and averages their gradients: the arithmetic data parallelism
// does. Each rank then computes its slice's loss and gradients bit for bit
// as the reference does (the same rows through the same kernels on the same
// parameters); the run differs only in the order the collectives add the
// slices' gradients, so every bound below is reordered_sum_bound() of the
// terms the reference recorded. Parameters after an optimizer step are held
// to what AdamWBound derives from those gradient bounds.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hp/fsdp/fully_shard.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/support/rounding_bounds.h"

namespace hp::test {

// What each reference gradient is a sum of: Σ|terms| elementwise (after the
// 1/parts scaling) and how many terms, keyed by the parameter.
struct GradientTerms {
  at::Tensor sum_abs;  // Double
  int64_t count = 0;
};
inline std::map<const void*, GradientTerms>& reference_gradient_terms() {
  static std::map<const void*, GradientTerms> terms;
  return terms;
}

// Runs `part_loss(p)` and its backward for p in [0, parts), each on fresh
// gradients of `computing`, sums each parameter's gradients in part order
// (cast to the dtype of `params`), divides by `parts` and adds the result to
// the gradients of `params` (the same tensors as `computing`, or the
// originals of a lower-precision copy). Records each gradient's terms
// (reference_gradient_terms). Returns the mean of the parts' losses.
inline at::Tensor data_parallel_backward(const std::vector<at::Tensor>& params,
                                         const std::vector<at::Tensor>& computing, int64_t parts,
                                         const std::function<at::Tensor(int64_t)>& part_loss) {
  std::vector<at::Tensor> earlier;
  for (const auto& param : params) earlier.push_back(param.grad());
  std::vector<at::Tensor> sum(params.size()), sum_abs(params.size());
  const at::ScalarType dtype = params.at(0).scalar_type();
  at::Tensor total = at::zeros({}, dtype);
  for (int64_t p = 0; p < parts; ++p) {
    for (auto param : computing) param.mutable_grad() = at::Tensor();
    at::Tensor loss = part_loss(p);
    loss.backward();
    total += loss.detach();
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = computing[i].grad();
      if (!g.defined()) continue;
      g = g.to(dtype);
      sum[i] = sum[i].defined() ? sum[i] + g : g;
      at::Tensor a = g.abs().to(at::kDouble) / static_cast<double>(parts);
      sum_abs[i] = sum_abs[i].defined() ? sum_abs[i] + a : a;
    }
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor param = params[i];
    GradientTerms& terms = reference_gradient_terms()[param.unsafeGetTensorImpl()];
    // A gradient zeroed in place (zero_grad) carries no terms any more.
    if (!earlier[i].defined() || !earlier[i].any().item<bool>()) terms = {};
    if (!sum[i].defined()) {
      param.mutable_grad() = earlier[i];
      continue;
    }
    at::Tensor grad = sum[i] / static_cast<double>(parts);
    param.mutable_grad() = earlier[i].defined() ? earlier[i] + grad : grad;
    terms.sum_abs = terms.sum_abs.defined() ? terms.sum_abs + sum_abs[i] : sum_abs[i];
    terms.count += parts;
  }
  return total / static_cast<double>(parts);
}

// How far a data-parallel run's mean loss over `parts` ranks may be from
// the reference's: the same per-part losses added in another order. For a
// non-negative loss (cross-entropy, MSE) Σ|terms| is the loss itself.
inline double loss_bound(const at::Tensor& reference_loss, int64_t parts) {
  return reordered_sum_bound(reference_loss.item<double>(), parts, reference_loss.scalar_type());
}

// The bound on each gradient of `reference` (times `scale`) that its
// recorded terms allow, whole tensors by name (Double).
template <typename Holder>
std::map<std::string, at::Tensor> gradient_bounds(Holder& reference, double scale = 1.0) {
  std::map<std::string, at::Tensor> bounds;
  for (auto& item : reference->named_parameters()) {
    auto it = reference_gradient_terms().find(item.value().unsafeGetTensorImpl());
    if (it == reference_gradient_terms().end() || !it->second.sum_abs.defined()) continue;
    bounds[item.key()] = reordered_sum_bound(it->second.sum_abs * std::abs(scale),
                                             it->second.count, item.value().scalar_type());
  }
  return bounds;
}

// Each gradient shard in `grads` (by name; a managed parameter's of the
// sharded `model`) against the matching shard of `reference`'s gradient
// times `scale`, within the matching shard of `bounds` (whole tensors by
// name, Double).
template <typename Holder>
void expect_gradient_shards_within(Holder& model, Holder& reference,
                                   const std::map<std::string, at::Tensor>& grads,
                                   const std::map<std::string, at::Tensor>& bounds,
                                   double scale = 1.0) {
  auto ref = reference->named_parameters();
  for (auto& [name, value] : FSDPModule(model.ptr()).state_dict()) {
    const DTensor& d = std::get<DTensor>(value);
    if (!bounds.count(name)) {
      ADD_FAILURE() << name << ": no reference backward recorded its terms";
      continue;
    }
    at::Tensor expected = distribute_tensor(ref[name].grad() * scale, d.layout()).local();
    at::Tensor grad = grads.count(name) ? grads.at(name) : at::Tensor();
    if (!grad.defined()) {
      ADD_FAILURE() << name << ": no gradient";
      continue;
    }
    EXPECT_EQ(grad.scalar_type(), expected.scalar_type()) << name;
    EXPECT_TRUE(within_bound(grad, expected, distribute_tensor(bounds.at(name), d.layout()).local()))
        << name << " gradient";
  }
}

// expect_gradient_shards_within for the .grad of the sharded `model`'s
// managed parameters.
template <typename Holder>
void expect_gradients_within(Holder& model, Holder& reference,
                             const std::map<std::string, at::Tensor>& bounds,
                             double scale = 1.0) {
  std::map<std::string, at::Tensor> grads;
  for (auto& item : model->named_parameters()) grads[item.key()] = item.value().grad();
  expect_gradient_shards_within(model, reference, grads, bounds, scale);
}

// expect_gradients_within the bounds the reference's recorded terms allow
// (gradient_bounds). Returns those bounds.
template <typename Holder>
std::map<std::string, at::Tensor> expect_gradients_match(Holder& model, Holder& reference,
                                                         double scale = 1.0) {
  std::map<std::string, at::Tensor> bounds = gradient_bounds(reference, scale);
  expect_gradients_within(model, reference, bounds, scale);
  return bounds;
}

// One MSE step on the global batch (x, y): the reference's backward over
// every rank's rows in turn (data_parallel_backward), the model's on this
// rank's rows (`before_backward` runs between its forward and backward).
// Checks the mean loss within loss_bound and each gradient shard within the
// bound its terms allow (expect_gradients_match); returns those bounds.
template <typename Holder>
std::map<std::string, at::Tensor> expect_mse_step_matches(
    Holder& model, Holder& reference, const at::Tensor& x, const at::Tensor& y,
    const std::function<void()>& before_backward = {}) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  at::Tensor ref_loss = data_parallel_backward(
      reference->parameters(), reference->parameters(), world, [&](int64_t part) {
        return torch::mse_loss(reference(rows_for(x, part, world)), rows_for(y, part, world));
      });
  at::Tensor loss = torch::mse_loss(model(rows_for(x, rank, world)), rows_for(y, rank, world));
  if (before_backward) before_backward();
  loss.backward();
  EXPECT_TRUE(within_bound(world_mean(loss.item<double>()), ref_loss.item<double>(),
                           loss_bound(ref_loss, world)))
      << "loss";
  return expect_gradients_match(model, reference);
}

// Sets every parameter shard of the sharded `model` to the matching shard
// of `reference`'s parameter: the next step's comparison starts from equal
// parameters.
template <typename Holder>
void copy_parameters(Holder& model, Holder& reference) {
  at::NoGradGuard no_grad;
  auto ref = reference->named_parameters();
  auto mine = model->named_parameters();
  for (auto& [name, value] : FSDPModule(model.ptr()).state_dict()) {
    const DTensor& d = std::get<DTensor>(value);
    mine[name].copy_(distribute_tensor(ref[name].detach(), d.layout()).local());
  }
}

// AdamW's step of both runs from equal parameters, then each parameter
// shard of `model` against the reference's within what `adam` derives from
// the gradient bounds `grad_bounds` (whole, by name). Zeroes both runs'
// gradients. Returns the parameters' bounds (whole, by name), for a later
// comparison of the same values gathered another way.
template <typename Holder>
std::map<std::string, at::Tensor> step_and_expect_parameters_match(Holder& model, Holder& reference,
                                      torch::optim::Optimizer& opt,
                                      torch::optim::Optimizer& ref_opt, AdamWBound& adam,
                                      const std::map<std::string, at::Tensor>& grad_bounds) {
  std::map<std::string, at::Tensor> bounds;
  for (auto& item : reference->named_parameters()) {
    if (!item.value().grad().defined()) continue;
    bounds[item.key()] = adam.step(item.key(), item.value().detach(), item.value().grad(),
                                   grad_bounds.at(item.key()));
  }
  ref_opt.step();
  ref_opt.zero_grad();
  opt.step();
  opt.zero_grad();
  auto ref = reference->named_parameters();
  auto mine = model->named_parameters();
  for (auto& [name, value] : FSDPModule(model.ptr()).state_dict()) {
    const DTensor& d = std::get<DTensor>(value);
    if (!bounds.count(name)) continue;
    EXPECT_TRUE(within_bound(mine[name], distribute_tensor(ref[name].detach(), d.layout()).local(),
                             distribute_tensor(bounds.at(name), d.layout()).local()))
        << name << " after the optimizer step";
  }
  return bounds;
}

}  // namespace hp::test
