#include "hp/nn/replace_parameter.h"

#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "hp/nn/hooked.h"
#include "hp/util/error.h"

namespace hp::nn {

namespace {

// torch::nn::Module keeps its registry in the protected `parameters_` and
// offers no way to replace an entry by a tensor of another type. A pointer
// to that member, formed inside a derived class (where naming it is
// allowed), reads it on any module.
struct RegistryAccess : torch::nn::Module {
  static torch::OrderedDict<std::string, at::Tensor>& of(torch::nn::Module& module) {
    return module.*(&RegistryAccess::parameters_);
  }
};

struct Registry {
  std::mutex mutex;
  std::map<std::type_index, ParameterFieldUpdater> updaters;

  Registry() {
    updaters[typeid(torch::nn::Module)] = [](torch::nn::Module&, const std::string&,
                                             const at::Tensor&) {};
    updaters[typeid(torch::nn::LinearImpl)] = [](torch::nn::Module& m, const std::string& name,
                                                 const at::Tensor& value) {
      auto& linear = dynamic_cast<torch::nn::LinearImpl&>(m);
      if (name == "weight") linear.weight = value;
      if (name == "bias") linear.bias = value;
    };
    updaters[typeid(torch::nn::EmbeddingImpl)] = [](torch::nn::Module& m, const std::string& name,
                                                    const at::Tensor& value) {
      if (name == "weight") dynamic_cast<torch::nn::EmbeddingImpl&>(m).weight = value;
    };
    updaters[typeid(torch::nn::LayerNormImpl)] = [](torch::nn::Module& m, const std::string& name,
                                                    const at::Tensor& value) {
      auto& norm = dynamic_cast<torch::nn::LayerNormImpl&>(m);
      if (name == "weight") norm.weight = value;
      if (name == "bias") norm.bias = value;
    };
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

struct Slot {
  torch::nn::Module* owner;
  std::string local_name;
  ParameterFieldUpdater updater;
};

}  // namespace

void register_parameter_fields(std::type_index type, ParameterFieldUpdater updater) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.updaters[type] = std::move(updater);
}

void replace_parameter(torch::nn::Module& root, const std::string& name, const at::Tensor& value) {
  auto named = root.named_parameters(/*recurse=*/true);
  const at::Tensor* old = named.find(name);
  if (old == nullptr) {
    std::vector<std::string> names;
    for (const auto& item : named) names.push_back(item.key());
    throw_argument_error(cat("replace_parameter: name '", name, "' is no parameter of ", root.name(),
                             "; its parameters are ", to_string(names)));
  }
  HP_CHECK_ARG(value.defined(), "replace_parameter: the value for '", name, "' is undefined");
  HP_CHECK_ARG(value.sizes() == old->sizes(), "replace_parameter: the value for '", name,
               "' has sizes ", value.sizes(), " but the parameter has ", old->sizes());
  const c10::TensorImpl* target = old->unsafeGetTensorImpl();

  // Every module that registers the same tensor (tied parameters), found
  // and checked before anything changes.
  std::vector<Slot> slots;
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto visit = [&](const std::string& prefix, torch::nn::Module& module) {
      for (auto& item : RegistryAccess::of(module)) {
        if (item.value().unsafeGetTensorImpl() != target) continue;
        const std::string full = prefix.empty() ? item.key() : prefix + "." + item.key();
        auto it = r.updaters.find(std::type_index(typeid(module)));
        HP_CHECK_ARG(it != r.updaters.end(), "replace_parameter: parameter '", full,
                     "' belongs to module '", prefix.empty() ? root.name() : prefix, "' of type ",
                     module.name(),
                     ", which may hold it in a member field that cannot be updated; register "
                     "its fields with hp::nn::register_parameter_fields");
        slots.push_back({&module, item.key(), it->second});
      }
    };
    root.apply([&](const std::string& prefix, torch::nn::Module& module) {
      if (auto* hooked = dynamic_cast<HookedBase*>(&module)) {
        // The wrapper shares the wrapped module's registry entries (hooked.h)
        // and has no fields of its own; the wrapped module's registry and
        // fields change as if it were in the tree under the same name. Its
        // submodules are the wrapper's, visited as such.
        for (auto& item : RegistryAccess::of(module)) {
          if (item.value().unsafeGetTensorImpl() == target) {
            slots.push_back({&module, item.key(), [](torch::nn::Module&, const std::string&,
                                                     const at::Tensor&) {}});
          }
        }
        visit(prefix, hooked->wrapped_module());
        return;
      }
      visit(prefix, module);
    });
  }
  for (Slot& slot : slots) {
    RegistryAccess::of(*slot.owner)[slot.local_name] = value;
    slot.updater(*slot.owner, slot.local_name, value);
  }
}

}  // namespace hp::nn
