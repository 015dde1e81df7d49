// One backward's reduced gradients of fully_shard parameters, handed to the
// caller instead of .grad: how parallelize_value_and_grad (S5 in
// docs/features.md) differentiates a model with fully_shard units.
//
// A unit reduces a parameter's gradient (reduce-scatter, HSDP's all-reduce)
// in the post-hook of the parameter's gradient accumulator and assigns the
// reduced shard to .grad (F4). torch::autograd::grad never runs the
// accumulators of its inputs, so over managed parameters it would return
// each rank's unreduced gradient of the unsharded parameter; the units
// refuse such a backward (RootContext::ensure_end_of_backward). Instead,
// the caller runs the usual backward restricted to its weights
// (torch::autograd::backward with inputs = the weights), so the
// accumulators, and with them the reductions, run as in any step, inside a
// GradCapture:
//
//   fsdp::check_capturable(weights, "parallelize_value_and_grad");  // before forward
//   ... forward ...
//   fsdp::GradCapture capture(weights);   // sets aside what they hold
//   torch::autograd::backward(outputs, grad_outputs, false, false, weights);
//   nn::TensorList grads = capture.finish();  // the reduced shards; puts back
//
// The weights then hold what they held before (.grad, main grads, no-sync
// and partially reduced gradients), also when the backward raises (the
// destructor puts it back after the units dropped what the backward had
// started). Parameters of the tree that are not among the weights get no
// gradient from the restricted backward, so theirs stay as they were, but
// a backward that raises drops them as it does for backward()
// (root_context.h).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/registry.h"
#include "hp/nn/module.h"

namespace hp::fsdp {

// Whether fully_shard manages any of `params`.
bool any_managed(const nn::TensorList& params);

// Raises ArgumentError (its message starting with `caller`) unless a
// GradCapture can deliver the reduced gradient of every one of `params`:
// each is a leaf (the backward fills .grad of leaves only), and every unit
// managing one reduces fully in a backward: gradient sync on and, under
// HSDP, the all-reduce over replicas on. Collective-free, so callers check
// before their forward.
void check_capturable(const nn::TensorList& params, const std::string& caller);

class GradCapture {
 public:
  // Sets aside the gradients `params` hold (of a plain parameter its .grad;
  // of a managed one everything FSDPParam::take_held_grads moves), after
  // the forward and before the backward.
  explicit GradCapture(nn::TensorList params);
  GradCapture(const GradCapture&) = delete;
  GradCapture& operator=(const GradCapture&) = delete;
  // Puts back what was set aside, unless finish() did.
  ~GradCapture();

  // After the backward: completes the reductions it left in flight
  // (set_is_last_backward(false) defers them to the next forward, but the
  // caller wants the result now), takes each parameter's gradient (of a
  // managed one, FSDPParam::take_delivered_grad: the reduced shard in its
  // layout) and puts back what was set aside. One tensor per parameter, in
  // order; undefined for one the backward gave no gradient.
  nn::TensorList finish();

 private:
  struct Held {
    at::Tensor param;
    std::optional<ManagedParam> managed;
    FSDPParam::HeldGrads grads;
  };
  void put_back() noexcept;

  nn::TensorList params_;
  std::vector<Held> held_;  // one per distinct parameter
  bool put_back_ = false;
};

}  // namespace hp::fsdp
