#include "hp/tp/value_and_grad.h"

#include <torch/csrc/autograd/autograd.h>

#include <ATen/ATen.h>

#include "hp/fsdp/grad_capture.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp {

namespace {

// A tensor shaped like `output` holding `value` everywhere, in the form the
// backward of `output` takes: for a DTensor, a DTensor whose Shard dims are
// the output's and whose other mesh dims are Replicate (a gradient is a
// global value; see value_and_grad.h).
at::Tensor initial_gradient_like(const at::Tensor& output, double value) {
  if (!is_dtensor(output)) return at::full_like(output, value);
  const Layout& layout = layout_of(output);
  Placements placements = layout.placements();
  for (Placement& p : placements) {
    if (p.is_partial()) p = Replicate();
  }
  const at::Tensor& local = local_of(output);
  at::Tensor initial_local = at::full(local.sizes(), value, local.options());
  FromLocalOptions options;
  options.shape = output.sizes().vec();
  return as_tensor(from_local(initial_local, Layout(layout.mesh(), placements), options));
}

}  // namespace

namespace detail {

void check_weights(const nn::TensorList& weights) {
  for (size_t i = 0; i < weights.size(); ++i) {
    HP_CHECK_ARG(weights[i].defined() && weights[i].requires_grad(),
                 "parallelize_value_and_grad: weight ", i,
                 " does not require grad; expected tensors that require grad (parameters)");
  }
  if (fsdp::any_managed(weights)) fsdp::check_capturable(weights, "parallelize_value_and_grad");
}

nn::TensorList parallel_grads(const nn::TensorList& outputs, const nn::TensorList& weights,
                              const std::optional<std::vector<double>>& sens) {
  HP_CHECK_ARG(!outputs.empty(), "parallelize_value_and_grad: fn returned no outputs");
  std::vector<double> sensitivities(outputs.size(), 0.0);
  if (sens) {
    HP_CHECK_ARG(sens->size() == outputs.size(), "parallelize_value_and_grad: sens has ",
                 sens->size(), " values but fn returned ", outputs.size(),
                 " outputs; expected one sensitivity per output");
    sensitivities = *sens;
  } else {
    sensitivities[0] = 1.0;
  }
  nn::TensorList differentiated, grad_outputs;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (sensitivities[i] == 0.0) continue;
    HP_CHECK_ARG(outputs[i].defined() && outputs[i].requires_grad(),
                 "parallelize_value_and_grad: output ", i, " has sensitivity ", sensitivities[i],
                 " but does not require grad");
    differentiated.push_back(outputs[i]);
    grad_outputs.push_back(initial_gradient_like(outputs[i], sensitivities[i]));
  }
  if (differentiated.empty() || weights.empty()) return nn::TensorList(weights.size());
  nn::TensorList grads;
  if (fsdp::any_managed(weights)) {
    // fully_shard reduces gradients as they accumulate, which
    // torch::autograd::grad never does: the usual backward, restricted to
    // the weights, with their reduced shards taken out of .grad
    // (hp/fsdp/grad_capture.h).
    fsdp::GradCapture capture(weights);
    torch::autograd::backward(differentiated, grad_outputs, /*retain_graph=*/false,
                              /*create_graph=*/false, /*inputs=*/weights);
    grads = capture.finish();
  } else {
    grads = torch::autograd::grad(differentiated, weights, grad_outputs, /*retain_graph=*/false,
                                  /*create_graph=*/false, /*allow_unused=*/true);
  }
  // A gradient comes in the layout the rules gave it (a Replicate bias
  // summed over rows sharded elsewhere arrives Partial); an optimizer
  // updates shards with shards, so each is moved into its weight's layout,
  // as backward() does for .grad. Every rank moves the same gradients in the
  // same order.
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined() && is_dtensor(grads[i]) && is_dtensor(weights[i]) &&
        layout_of(grads[i]) != layout_of(weights[i])) {
      grads[i] = redistribute(grads[i], layout_of(weights[i]));
    }
  }
  return grads;
}

}  // namespace detail

}  // namespace hp
