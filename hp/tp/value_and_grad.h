// parallelize_value_and_grad: a loss and its gradients for a model whose
// values are DTensors (S5 in docs/features.md).
//
//   auto step = hp::parallelize_value_and_grad(
//       [&](const at::Tensor& x, const at::Tensor& y) { return mse(model(x), y); },
//       model->parameters());
//   auto [loss, grads] = step(x, y);       // grads[i]: d loss / d parameters()[i]
//
// The returned function runs `fn` once and differentiates its result with
// respect to `weights`: nothing is accumulated into .grad; an undefined
// tensor for a weight the result does not depend on. The gradient of a
// DTensor weight has the weight's layout, as .grad would. The weights are
// checked (see below) before `fn` runs.
//
// The initial gradient of a DTensor loss is a DTensor of the same global
// shape holding the sensitivity everywhere. Gradients of DTensors are global
// values (hp/tensor/dtensor.h): its Shard dims follow the loss's, and its
// other mesh dims are Replicate, each rank holding the sensitivity itself.
// Each element of the loss lives on repeat_num ranks, but the initial
// gradient is not counted repeat_num times, because backwards that sum
// ranks' contributions sum Partial gradients, and a Replicate one is not
// summed: the gradients equal a single process's, with no collective added
// for it. (A framework whose gradients of replicated values are per-rank
// partial sums starts from sensitivity / repeat_num on each rank instead;
// the two are the same global gradient.) A plain tensor loss starts from
// the sensitivity.
//
// Sensitivities: a function returning one tensor gets 1 (and takes no sens:
// passing one does not compile). A function returning several tensors gets
// 1 for the first and 0 for the others, or `sens`, one per output (another
// count is an ArgumentError, raised before the backward's collectives);
// outputs with sensitivity 0 are not differentiated at all.
//
// Weights that fully_shard units manage (F4) get what .grad would hold
// after backward(): the reduced gradient shard (reduce-scattered, and
// all-reduced over HSDP's replicas), in the parameter's own layout between
// steps (a plain shard-shaped tensor, or under tensor parallelism a DTensor
// of the combined layout); with apply_grad_on_fp32_main_grad, the reduced
// shard a main grad would receive. A unit reduces as gradients accumulate,
// which torch::autograd::grad never does (over managed parameters it raises
// an ArgumentError instead of returning unreduced gradients), so for such
// weights the function runs backward restricted to `weights` and takes the
// shards out of .grad (hp/fsdp/grad_capture.h): every weight's .grad (and
// main grad, and no-sync or partly reduced gradients) is as before, also
// when the backward raises; reductions deferred by set_is_last_backward(false)
// are completed. The units of those weights must reduce fully: gradient
// sync and HSDP's all-reduce on, else an ArgumentError; the weights must
// then all be leaves. Without such weights the function differentiates
// with torch::autograd::grad.
#pragma once

#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/nn/module.h"

namespace hp {

template <typename Value>
struct ValueAndGrad {
  Value value;           // what fn returned
  nn::TensorList grads;  // one per weight, in order
};

namespace detail {

// Raises ArgumentError unless every weight requires grad and, when
// fully_shard manages some, they can be differentiated as described above.
void check_weights(const nn::TensorList& weights);

// The gradients of `weights` for `outputs` started from `sens` (nullopt:
// 1 for the first output, 0 for the others); see above.
nn::TensorList parallel_grads(const nn::TensorList& outputs, const nn::TensorList& weights,
                              const std::optional<std::vector<double>>& sens);

}  // namespace detail

// `fn` returns one at::Tensor.
template <typename Fn>
auto parallelize_value_and_grad(Fn fn, nn::TensorList weights) {
  return [fn = std::move(fn), weights = std::move(weights)](auto&&... args) {
    detail::check_weights(weights);
    auto value = fn(std::forward<decltype(args)>(args)...);
    using Value = decltype(value);
    if constexpr (std::is_same_v<Value, at::Tensor>) {
      nn::TensorList grads = detail::parallel_grads({value}, weights, std::nullopt);
      return ValueAndGrad<at::Tensor>{std::move(value), std::move(grads)};
    } else {
      static_assert(std::is_same_v<Value, nn::TensorList>,
                    "parallelize_value_and_grad: fn must return at::Tensor or a TensorList");
      nn::TensorList grads = detail::parallel_grads(value, weights, std::nullopt);
      return ValueAndGrad<nn::TensorList>{std::move(value), std::move(grads)};
    }
  };
}

// `fn` returns several tensors (a TensorList); `sens` has one value each.
template <typename Fn>
auto parallelize_value_and_grad(Fn fn, nn::TensorList weights, std::vector<double> sens) {
  return [fn = std::move(fn), weights = std::move(weights),
          sens = std::move(sens)](auto&&... args) {
    detail::check_weights(weights);
    auto value = fn(std::forward<decltype(args)>(args)...);
    static_assert(std::is_same_v<decltype(value), nn::TensorList>,
                  "parallelize_value_and_grad: sens is for a fn with several outputs (returning "
                  "a TensorList); a fn with one output starts from 1 and takes no sens");
    nn::TensorList grads = detail::parallel_grads(value, weights, sens);
    return ValueAndGrad<nn::TensorList>{std::move(value), std::move(grads)};
  };
}

}  // namespace hp
