#include "hp/tp/shard_module.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <optional>
#include <utility>

#include "hp/nn/replace_parameter.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp {

namespace {

constexpr const char* kArgNamesKey = "hp.forward_arg_names";

// A planned layout, resolved on the mesh. The alias form fixes the tensor's
// number of dims, checked when a value arrives.
struct Planned {
  Layout layout;
  int64_t alias_ndim = -1;
};

// One input_plan or output_plan entry, resolved: layouts by position (by
// name entries are mapped to positions through the argument names).
struct Resolved {
  std::string what;  // "input_plan['fc.input']", for messages
  bool is_output = false;
  std::vector<std::optional<Planned>> positional;
};

Planned plan_layout(const PlanLayout& layout, const DeviceMeshPtr& mesh, const std::string& what) {
  return {layout.resolve(mesh, /*tensor_ndim=*/-1, what),
          layout.alias_ndim()};
}

Resolved resolve_entry(const ForwardLayouts& layouts, const DeviceMeshPtr& mesh,
                       const std::string& what, bool is_output,
                       const std::vector<std::string>& arg_names) {
  Resolved r;
  r.what = what;
  r.is_output = is_output;
  if (!layouts.is_by_name()) {
    for (size_t i = 0; i < layouts.positional().size(); ++i) {
      const auto& entry = layouts.positional()[i];
      if (entry) {
        r.positional.emplace_back(plan_layout(*entry, mesh, cat(what, "[", i, "]")));
      } else {
        r.positional.emplace_back(std::nullopt);
      }
    }
    return r;
  }
  HP_CHECK_ARG(!is_output, what, ": outputs have no names; give their layouts by position");
  HP_CHECK_ARG(!arg_names.empty(), what, ": layouts by argument name ",
               "need the forward's argument names, but none were declared ",
               "(hp::set_forward_arg_names, or shard_module's arg_names for a function)");
  r.positional.resize(arg_names.size());
  for (const auto& [name, layout] : layouts.by_name()) {
    size_t pos = 0;
    while (pos < arg_names.size() && arg_names[pos] != name) ++pos;
    HP_CHECK_ARG(pos < arg_names.size(), what, ": argument '", name,
                 "' is configured with a layout, but the forward's arguments are ",
                 to_string(arg_names));
    r.positional[pos] = plan_layout(layout, mesh, cat(what, "['", name, "']"));
  }
  return r;
}

// Redistributes the DTensors among `values` (a call's inputs or outputs) to
// their planned layouts. Every check precedes the first collective, and
// depends only on what every rank sees alike (counts, dims, layouts).
nn::TensorList apply_layouts(const Resolved& r, const nn::TensorList& values) {
  if (r.is_output) {
    HP_CHECK_ARG(values.size() == r.positional.size(), r.what, ": the number of outputs and ",
                 "of planned layouts must be equal, but got ", values.size(), " outputs and ",
                 r.positional.size(), " layouts");
  }
  std::vector<std::optional<Layout>> targets(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    const at::Tensor& value = values[i];
    if (!value.defined() || !is_dtensor(value)) continue;
    HP_CHECK_ARG(i < r.positional.size(), r.what, ": ", r.is_output ? "output " : "input ", i,
                 " is a DTensor but the plan gives layouts for ", r.positional.size(),
                 " positions; give it one (or std::nullopt to leave it as it is)");
    const auto& planned = r.positional[i];
    if (!planned) continue;
    HP_CHECK_ARG(planned->alias_ndim < 0 || planned->alias_ndim == value.dim(), r.what, "[", i,
                 "]: the alias layout has ", planned->alias_ndim, " entries but the ",
                 r.is_output ? "output" : "input", " has ", value.dim(), " dims");
    try {
      targets[i] = planned->layout.normalized(value.dim());
    } catch (const ArgumentError& e) {
      throw ArgumentError(cat(r.what, "[", i, "]: ", e.what()));
    }
  }
  nn::TensorList result = values;
  for (size_t i = 0; i < values.size(); ++i) {
    if (targets[i]) result[i] = redistribute(values[i], *targets[i]);
  }
  return result;
}

nn::TensorList to_local_outputs(const nn::TensorList& outputs) {
  nn::TensorList result = outputs;
  for (at::Tensor& t : result) {
    if (t.defined() && is_dtensor(t)) t = to_local(t);
  }
  return result;
}

// Splits "fc.input" into ("fc", "input") and "input" into ("", "input").
std::pair<std::string, std::string> split_key(const std::string& key) {
  const auto dot = key.rfind('.');
  if (dot == std::string::npos) return {"", key};
  return {key.substr(0, dot), key.substr(dot + 1)};
}

std::vector<std::string> module_names(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules) {
  std::vector<std::string> names;
  for (const auto& item : modules) names.push_back(item.key().empty() ? "''" : item.key());
  return names;
}

// The hookable module called `name`, or ArgumentError naming `what`.
std::shared_ptr<nn::Module> hookable(
    const torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>& modules,
    const std::string& name, const std::string& what) {
  const auto* found = modules.find(name);
  HP_CHECK_ARG(found != nullptr, what, ": ", name.empty() ? "the module" : name,
               " is configured with a layout, but no instance was found. The modules are ",
               to_string(module_names(modules)));
  auto module = std::dynamic_pointer_cast<nn::Module>(*found);
  HP_CHECK_ARG(module != nullptr, what, ": module '", name, "' is a ", (*found)->name(),
               ", which has no forward hooks; only hp::nn::Module submodules ",
               "(hp/nn/module.h) can have their inputs and outputs laid out");
  // torch::nn::Sequential calls its modules' forward directly: the hooks
  // would never run (N1).
  if (!name.empty()) {
    const auto dot = name.rfind('.');
    const std::string parent = dot == std::string::npos ? "" : name.substr(0, dot);
    const auto* container = modules.find(parent);
    HP_CHECK_ARG(container == nullptr ||
                     dynamic_cast<const torch::nn::SequentialImpl*>(container->get()) == nullptr,
                 what, ": module '", name, "' is inside the torch::nn::Sequential '",
                 parent.empty() ? "<root>" : parent, "', which calls its modules' forward "
                 "directly, so the plan's hooks would never run; use hp::nn::Sequential "
                 "(hp/nn/sequential.h), which calls them through their hooks");
  }
  return module;
}

struct ParamChange {
  std::string name;
  at::Tensor param;
  Layout layout;
};

}  // namespace

void set_forward_arg_names(nn::Module& module, std::vector<std::string> names) {
  module.set_attachment(kArgNamesKey, std::make_shared<std::vector<std::string>>(std::move(names)));
}

std::vector<std::string> forward_arg_names(const nn::Module& module) {
  auto names = module.attachment<std::vector<std::string>>(kArgNamesKey);
  return names ? *names : std::vector<std::string>{};
}

std::shared_ptr<torch::nn::Module> shard_module(const std::shared_ptr<torch::nn::Module>& module,
                                               const DeviceMeshPtr& mesh, const ShardingPlan& plan) {
  HP_CHECK_ARG(module != nullptr, "shard_module: module is null");
  HP_CHECK_ARG(mesh != nullptr, "shard_module: mesh is null");

  // Parameters: each named one found, its layout resolved for its dims.
  // Tied parameters (one tensor under several names) take one layout.
  auto params = module->named_parameters(/*recurse=*/true);
  std::vector<ParamChange> changes;
  std::map<const void*, std::pair<std::string, Layout>> planned_by_tensor;
  for (const auto& [name, plan_layout] : plan.plan) {
    const std::string what = cat("shard_module: plan['", name, "']");
    const at::Tensor* param = params.find(name);
    if (param == nullptr) {
      std::vector<std::string> names;
      for (const auto& item : params) names.push_back(item.key());
      throw_argument_error(cat(what, ": ", name,
                               " is configured with a layout, but no instance was found. The "
                               "parameters are ",
                               to_string(names)));
    }
    Layout layout = plan_layout.resolve(mesh, param->dim(), what);
    const void* key = param->unsafeGetTensorImpl();
    auto [it, inserted] = planned_by_tensor.emplace(key, std::make_pair(name, layout));
    if (!inserted) {
      HP_CHECK_ARG(it->second.second == layout, what, ": ", name, " is the same tensor as ",
                   it->second.first, ", which the plan gives ", it->second.second.str(),
                   "; tied parameters take one layout, not ", layout.str());
      continue;
    }
    if (is_dtensor(*param)) {
      HP_CHECK_ARG(layout_of(*param) == layout, what, ": ", name, " is already a DTensor of ",
                   layout_of(*param).str(), "; the plan asks for ", layout.str());
      continue;
    }
    changes.push_back({name, *param, layout});
  }

  // Hooks: every key names a hookable module and ends in the right suffix.
  auto modules = module->named_modules(/*name_prefix=*/"", /*include_self=*/true);
  struct HookPlan {
    std::shared_ptr<nn::Module> module;
    Resolved resolved;
  };
  std::vector<HookPlan> pre_hooks, post_hooks;
  for (const auto* forward_plan : {&plan.input_plan, &plan.output_plan}) {
    const bool is_output = forward_plan == &plan.output_plan;
    const std::string suffix = is_output ? "output" : "input";
    const std::string plan_name = is_output ? "output_plan" : "input_plan";
    for (const auto& [key, layouts] : *forward_plan) {
      const std::string what = cat("shard_module: ", plan_name, "['", key, "']");
      auto [prefix, last] = split_key(key);
      HP_CHECK_ARG(last == suffix, what, ": ", plan_name, " keys must end with '", suffix,
                   "' ('<module>.", suffix, "', or '", suffix, "' for the module itself), but got '",
                   last, "'");
      auto target = hookable(modules, prefix, what);
      Resolved resolved = resolve_entry(layouts, mesh, what, is_output, forward_arg_names(*target));
      (is_output ? post_hooks : pre_hooks).push_back({target, std::move(resolved)});
    }
  }
  std::vector<std::shared_ptr<nn::Module>> local_outputs;
  for (const auto& name : plan.return_local_tensor) {
    local_outputs.push_back(
        hookable(modules, name, cat("shard_module: return_local_tensor '", name, "'")));
  }

  // One process: nothing to split or move.
  if (mesh->size() == 1) return module;

  for (const ParamChange& change : changes) {
    nn::replace_parameter(*module, change.name, distribute(change.param, change.layout));
  }
  for (HookPlan& hook : pre_hooks) {
    hook.module->register_forward_pre_hook(
        [resolved = std::move(hook.resolved)](nn::Module&, const nn::TensorList& inputs)
            -> std::optional<nn::TensorList> { return apply_layouts(resolved, inputs); });
  }
  // Outputs are laid out first, then made local.
  for (HookPlan& hook : post_hooks) {
    hook.module->register_forward_hook(
        [resolved = std::move(hook.resolved)](nn::Module&, const nn::TensorList&,
                                              const nn::TensorList& outputs)
            -> std::optional<nn::TensorList> { return apply_layouts(resolved, outputs); });
  }
  for (auto& target : local_outputs) {
    target->register_forward_hook(
        [](nn::Module&, const nn::TensorList&, const nn::TensorList& outputs)
            -> std::optional<nn::TensorList> { return to_local_outputs(outputs); });
  }
  return module;
}

namespace detail {

TensorFunction shard_function(TensorFunction fn, const DeviceMeshPtr& mesh,
                              const ShardingPlan& plan, std::vector<std::string> arg_names) {
  HP_CHECK_ARG(fn != nullptr, "shard_module: the function is empty");
  HP_CHECK_ARG(mesh != nullptr, "shard_module: mesh is null");
  HP_CHECK_ARG(plan.plan.empty(), "shard_module: plan gives ", plan.plan.size(),
               " parameter layouts, but a function has no parameters");
  HP_CHECK_ARG(plan.return_local_tensor.empty(), "shard_module: return_local_tensor names ",
               to_string(plan.return_local_tensor), ", but a function has no submodules");
  for (const auto& [key, layouts] : plan.input_plan) {
    HP_CHECK_ARG(key == "input", "shard_module: input_plan['", key,
                 "']: a function's input_plan has the one key 'input'");
  }
  for (const auto& [key, layouts] : plan.output_plan) {
    HP_CHECK_ARG(key == "output", "shard_module: output_plan['", key,
                 "']: a function's output_plan has the one key 'output'");
  }
  std::optional<Resolved> in, out;
  if (auto it = plan.input_plan.find("input"); it != plan.input_plan.end()) {
    in = resolve_entry(it->second, mesh, "shard_module: input_plan['input']", false, arg_names);
  }
  if (auto it = plan.output_plan.find("output"); it != plan.output_plan.end()) {
    out = resolve_entry(it->second, mesh, "shard_module: output_plan['output']", true, {});
  }
  if (mesh->size() == 1) return fn;
  return [fn = std::move(fn), in = std::move(in), out = std::move(out)](const nn::TensorList& args) {
    nn::TensorList outputs = fn(in ? apply_layouts(*in, args) : args);
    return out ? apply_layouts(*out, outputs) : outputs;
  };
}

}  // namespace detail

}  // namespace hp
