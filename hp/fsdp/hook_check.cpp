#include "hp/fsdp/hook_check.h"

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <unordered_set>

#include "hp/fsdp/unit.h"
#include "hp/util/error.h"

namespace hp::fsdp {
namespace {

const char* const kWhatToDo =
    "call it through its holder (`m(x)`, not `m->forward(x)`), put it in an "
    "hp::nn::Sequential or hp::nn::ModuleList (hp/nn/sequential.h, module_list.h) instead of "
    "torch::nn's, or wrap the module that calls it with hp::nn::hooked (hp/nn/hooked.h)";

bool is_unit(const torch::nn::Module& module) {
  auto* hookable = dynamic_cast<const nn::Module*>(&module);
  return hookable != nullptr && hookable->attachment<Unit>(kUnitAttachment) != nullptr;
}

std::string shown(const std::string& fqn) { return fqn.empty() ? "<root>" : fqn; }

}  // namespace

void check_units_called_through_hooks(const std::vector<std::shared_ptr<nn::Module>>& roots) {
  for (const auto& root : roots) {
    for (const auto& item : root->named_modules()) {
      if (dynamic_cast<const torch::nn::SequentialImpl*>(item.value().get()) == nullptr) continue;
      for (const auto& child : item.value()->named_children()) {
        if (!is_unit(*child.value())) continue;
        const std::string fqn = item.key().empty() ? child.key() : item.key() + "." + child.key();
        throw_argument_error(cat(
            "fully_shard: module '", fqn, "' (", child.value()->name(), ") of ", root->name(),
            " is a fully_shard unit inside the torch::nn::Sequential '", shown(item.key()),
            "', which calls its modules' forward directly, so the unit's hooks (gather before "
            "forward, reshard after) would never run and its forward would compute on the "
            "shards. Use hp::nn::Sequential (hp/nn/sequential.h), which calls them through "
            "their hooks; in general, ",
            kWhatToDo));
      }
    }
  }
}

void check_units_ran(const std::vector<std::shared_ptr<nn::Module>>& root_modules,
                     const std::vector<std::shared_ptr<Unit>>& units,
                     const std::vector<const Unit*>& ran, const nn::TensorList& outputs) {
  std::vector<const Unit*> silent;
  for (const auto& unit : units) {
    if (std::find(ran.begin(), ran.end(), unit.get()) == ran.end()) silent.push_back(unit.get());
  }
  if (silent.empty()) return;
  // Every autograd node the outputs depend on.
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  for (const auto& out : outputs) {
    if (out.defined() && out.grad_fn()) stack.push_back(out.grad_fn().get());
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  for (const Unit* unit : silent) {
    for (const auto& p : unit->params()) {
      const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(p->param());
      if (!accumulator || !seen.count(accumulator.get())) continue;
      // The unit's modules by their names in the root's tree.
      std::vector<std::string> names;
      for (const auto& module : unit->modules()) {
        std::string name = module->name();
        for (const auto& root : root_modules) {
          for (const auto& item : root->named_modules()) {
            if (item.value().get() == module.get()) name = shown(item.key());
          }
        }
        names.push_back(name);
      }
      throw_argument_error(cat(
          "fully_shard: the unit of module ", names.size() == 1 ? names[0] : to_string(names),
          " (", unit->name(), ") took part in this forward (its parameter '", p->fqn(),
          "' is in the output's autograd graph) but its forward pre-hook did not run, so it "
          "computed on the parameters' shards instead of gathering them. To run the hooks, ",
          kWhatToDo));
    }
  }
}

}  // namespace hp::fsdp
