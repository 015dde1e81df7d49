// Replacing a registered parameter by a tensor of another kind (used by
// shard_module to turn parameters into tensor-form DTensors).
//
// `param.set_data(x)` cannot do it when `x` has another TensorImpl type
// ("incompatible tensor type"), so the replacement swaps the tensor itself:
// in the parameter registry of every module of `root`'s tree that holds the
// same tensor (tied parameters stay tied), and in the public member fields
// through which modules read their parameters in forward
// (torch::nn::Linear's `weight` and `bias`, Embedding's `weight`,
// LayerNorm's `weight` and `bias`; through an hp::nn::Hooked wrapper, the
// wrapped module's, hooked.h). A module that owns the parameter and
// whose type replace_parameter does not know may hold a copy in a field it
// cannot see; rather than leave that copy stale, it raises ArgumentError
// naming the module and the parameter, before changing anything.
// register_parameter_fields teaches it a module type (an updater that does
// nothing declares a type that reads its parameters through the registry).
//
// An optimizer built before the replacement still holds the old tensors;
// build it after.
#pragma once

#include <functional>
#include <string>
#include <typeindex>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

namespace hp::nn {

// Replaces the parameter called `name` ("mlp.c_fc.weight", as
// named_parameters() has it) of `root` by `value`, which must have the same
// sizes. Every registration of the same tensor in `root`'s tree is
// replaced. ArgumentError, with nothing changed, for an unknown name, a size
// mismatch, or an owning module whose fields cannot be updated.
void replace_parameter(torch::nn::Module& root, const std::string& name, const at::Tensor& value);

// Called with the owning module, the parameter's name in it ("weight") and
// the new tensor; assigns the member field that holds that parameter.
using ParameterFieldUpdater =
    std::function<void(torch::nn::Module& owner, const std::string& local_name,
                       const at::Tensor& value)>;

// Registers how to update the fields of modules of dynamic type `type`
// (replacing an earlier registration).
void register_parameter_fields(std::type_index type, ParameterFieldUpdater updater);

template <typename Impl>
void register_parameter_fields(
    std::function<void(Impl&, const std::string& local_name, const at::Tensor& value)> updater) {
  register_parameter_fields(
      std::type_index(typeid(Impl)),
      [updater = std::move(updater)](torch::nn::Module& owner, const std::string& local_name,
                                     const at::Tensor& value) {
        updater(dynamic_cast<Impl&>(owner), local_name, value);  // Module is a virtual base
      });
}

}  // namespace hp::nn
