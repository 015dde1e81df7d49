// shard_module: tensor parallelism by plan (S1-S3 in docs/features.md).
//
//   auto mesh = hp::init_device_mesh("cpu", {world}, {"tp"});
//   hp::ShardingPlan plan;
//   plan.plan = {{"fc1.weight", {hp::Shard(0)}}, {"fc1.bias", {hp::Shard(0)}},
//                {"fc2.weight", {hp::Shard(1)}}};
//   plan.input_plan = {{"input", {hp::Replicate()}}};
//   plan.output_plan = {{"output", {hp::Replicate()}}};
//   hp::shard_module(model, mesh, plan);
//   torch::optim::AdamW optimizer(model->parameters(), options);   // after sharding
//
// Parameters named in plan.plan become tensor-form DTensors of their layout
// (hp/tensor/dtensor_tensor.h): every rank splits its own full value, with no
// communication, so the model must hold the same values on every rank. A
// parameter on the meta device becomes a DTensor with a meta local shard,
// which hp::init_sharded or hp::checkpoint::load_into_shards materialises
// (hp/fsdp/materialize.h, F17).
// They replace the registered parameters (hp/nn/replace_parameter.h; tied
// parameters stay tied), so model->parameters() and the modules' fields see
// them, and ordinary libtorch code runs on them through the DTensor op
// rules.
//
// input_plan and output_plan install forward pre-hooks and hooks on the
// named submodules, which must be hp::nn::Modules (hp/nn/module.h). A hook
// redistributes the DTensor values among the inputs or outputs to the
// planned layouts (differentiably); plain tensors and undefined tensors
// pass untouched, as do positions the plan leaves empty. A DTensor input at
// a position the plan gives no layout, or an output count that differs
// from the planned one, raises ArgumentError in the call, before that
// hook's collectives. return_local_tensor makes the named submodules return
// local shards (hp::to_local) instead of DTensors.
//
// Every argument is validated before anything changes: unknown parameter
// or module names ("fc3.weight is configured with a layout, but no instance
// was found."), keys without the ".input" / ".output" suffix, layouts that
// do not fit the mesh or the parameter, submodules without hooks. On a
// mesh of one rank, shard_module validates the plan and changes nothing:
// one process needs no tensor parallelism.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/nn/pimpl.h>

#include "hp/mesh/device_mesh.h"
#include "hp/nn/module.h"
#include "hp/tp/sharding_plan.h"

namespace hp {

// Shards `module` by `plan` over `mesh` (see above) and returns it.
std::shared_ptr<torch::nn::Module> shard_module(const std::shared_ptr<torch::nn::Module>& module,
                                               const DeviceMeshPtr& mesh, const ShardingPlan& plan);

template <typename Impl>
std::shared_ptr<Impl> shard_module(const torch::nn::ModuleHolder<Impl>& module,
                                   const DeviceMeshPtr& mesh, const ShardingPlan& plan) {
  shard_module(std::static_pointer_cast<torch::nn::Module>(module.ptr()), mesh, plan);
  return module.ptr();
}

// A function over tensors, as shard_module wraps it.
using TensorFunction = std::function<nn::TensorList(const nn::TensorList&)>;

namespace detail {
TensorFunction shard_function(TensorFunction fn, const DeviceMeshPtr& mesh,
                              const ShardingPlan& plan, std::vector<std::string> arg_names);
template <typename Fn>
using IsTensorFunction = std::conjunction<
    std::negation<std::is_base_of<torch::detail::ModuleHolderIndicator, std::decay_t<Fn>>>,
    std::is_convertible<Fn, TensorFunction>>;
}  // namespace detail

// Wraps a plain function: the returned one redistributes the DTensor
// arguments by plan.input_plan["input"] and the DTensor results by
// plan.output_plan["output"], as the hooks do for a module. `arg_names`
// names the arguments for a by-name input layout. A plan with parameters,
// return_local_tensor or other keys is an ArgumentError: a function has
// nothing else to shard. On a one-rank mesh `fn` itself is returned.
// (A template only so that a module holder, callable too, is never
// mistaken for a function.)
template <typename Fn, std::enable_if_t<detail::IsTensorFunction<Fn>::value, int> = 0>
TensorFunction shard_module(Fn&& fn, const DeviceMeshPtr& mesh, const ShardingPlan& plan,
                            std::vector<std::string> arg_names = {}) {
  return detail::shard_function(TensorFunction(std::forward<Fn>(fn)), mesh, plan,
                                std::move(arg_names));
}

// Names `module`'s forward arguments, in order, so that an input_plan entry
// of ForwardLayouts::by_name can address them. C++ keeps no parameter names
// at run time; a module (or its user) declares them once, e.g. in its
// constructor: hp::set_forward_arg_names(*this, {"x", "mask"}).
void set_forward_arg_names(nn::Module& module, std::vector<std::string> names);
// The names declared for `module`, empty if none.
std::vector<std::string> forward_arg_names(const nn::Module& module);

}  // namespace hp
