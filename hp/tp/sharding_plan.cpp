#include "hp/tp/sharding_plan.h"

#include <torch/torch.h>

#include <utility>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp {

PlanLayout::PlanLayout(std::initializer_list<PlanDim> alias) {
  AliasPlacements entries;
  for (const PlanDim& dim : alias) entries.push_back(dim.names());
  spec_ = std::move(entries);
}

Layout PlanLayout::resolve(const DeviceMeshPtr& mesh, int64_t tensor_ndim,
                           const std::string& what) const {
  HP_CHECK_ARG(mesh != nullptr, what, ": the mesh is null");
  try {
    if (const auto* placements = std::get_if<Placements>(&spec_)) {
      HP_CHECK_ARG(static_cast<int64_t>(placements->size()) == mesh->ndim(), "layout ",
                   to_string(*placements), " has ", placements->size(),
                   " placements but the mesh has ", mesh->ndim(), " dims ",
                   to_string(mesh->dim_names()), "; expected one placement per mesh dim");
      Layout layout(mesh, *placements);
      return tensor_ndim >= 0 ? layout.normalized(tensor_ndim) : layout;
    }
    const auto& alias = std::get<AliasPlacements>(spec_);
    HP_CHECK_ARG(tensor_ndim < 0 || static_cast<int64_t>(alias.size()) == tensor_ndim,
                 "layout ", str(), " has ", alias.size(), " entries but the tensor has ",
                 tensor_ndim, " dims; the alias form has one entry per tensor dim");
    return Layout::from_alias(mesh, alias);
  } catch (const ArgumentError& e) {
    throw ArgumentError(cat(what, ": ", e.what()));
  }
}

std::string PlanLayout::str() const {
  if (const auto* placements = std::get_if<Placements>(&spec_)) return to_string(*placements);
  std::string out = "(";
  const auto& alias = std::get<AliasPlacements>(spec_);
  for (size_t d = 0; d < alias.size(); ++d) {
    if (d > 0) out += ", ";
    out += alias[d].size() == 1 ? cat("'", alias[d][0], "'") : to_string(alias[d]);
  }
  return out + ")";
}

ForwardLayouts ForwardLayouts::positional(std::vector<std::optional<PlanLayout>> layouts) {
  ForwardLayouts result;
  result.positional_ = std::move(layouts);
  return result;
}

ForwardLayouts ForwardLayouts::by_name(std::map<std::string, PlanLayout> layouts) {
  ForwardLayouts result;
  result.by_name_ = std::move(layouts);
  return result;
}

ShardingPlan plan_for_part(const ShardingPlan& plan, const torch::nn::Module& part) {
  ShardingPlan share;
  for (const auto& item : part.named_parameters(/*recurse=*/true)) {
    if (auto it = plan.plan.find(item.key()); it != plan.plan.end()) share.plan.insert(*it);
  }
  const auto modules = part.named_modules("", /*include_self=*/false);
  // "<module>.input" / "<module>.output" of one of the part's modules.
  auto of_part = [&](const std::string& key, const std::string& suffix) {
    return key.size() > suffix.size() &&
           key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0 &&
           modules.contains(key.substr(0, key.size() - suffix.size()));
  };
  for (const auto& entry : plan.input_plan)
    if (of_part(entry.first, ".input")) share.input_plan.insert(entry);
  for (const auto& entry : plan.output_plan)
    if (of_part(entry.first, ".output")) share.output_plan.insert(entry);
  for (const std::string& name : plan.return_local_tensor)
    if (!name.empty() && modules.contains(name)) share.return_local_tensor.push_back(name);
  return share;
}

}  // namespace hp
