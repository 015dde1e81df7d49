// ShardingPlan: what shard_module does to a module (S1, S2 in
// docs/features.md).
//
//   hp::ShardingPlan plan;
//   plan.plan["fc1.weight"] = {hp::Shard(0)};            // parameters by qualified name
//   plan.plan["fc2.weight"] = {"None", "tp"};            // the alias form, one entry per tensor dim
//   plan.input_plan["input"] = {hp::Replicate()};        // the root module's first input
//   plan.output_plan["fc2.output"] = {hp::Replicate()};  // submodule fc2's output
//   plan.return_local_tensor = {"fc2"};                  // fc2 returns local tensors
//
// A layout in a plan is written without its mesh (shard_module supplies it),
// either as placements, one per mesh dim ({Shard(0), Replicate()}), or in
// the alias form, one entry per tensor dim: a mesh dim name ("tp"), "None"
// (not sharded), or several names ({"dp", "tp"}: sharded over both, the last
// varying fastest). See hp/tensor/layout.h.
//
// input_plan keys are "<module>.input" ("input" alone: the module given to
// shard_module), output_plan keys "<module>.output". The value is one layout
// (the first input, or the only output), a list by position
// (ForwardLayouts::positional), or, for inputs, a map by argument name
// (ForwardLayouts::by_name; see set_forward_arg_names in shard_module.h).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "hp/tensor/layout.h"
#include "hp/tensor/placement.h"

namespace torch::nn {
class Module;
}

namespace hp {

// One tensor dim of a layout in the alias form: "tp", "None", {"dp", "tp"}.
// The constructors here are implicit on purpose: plans are written as
// braced lists.
class PlanDim {
 public:
  PlanDim(const char* name) : names_{name} {}
  PlanDim(std::string name) : names_{std::move(name)} {}
  PlanDim(std::initializer_list<std::string> names) : names_(names) {}
  const DimAlias& names() const { return names_; }

 private:
  DimAlias names_;
};

// A layout as a plan writes it: placements or the alias form, no mesh.
class PlanLayout {
 public:
  PlanLayout() = default;  // no placements: resolves only on a 0-d mesh
  PlanLayout(Placements placements) : spec_(std::move(placements)) {}
  PlanLayout(std::initializer_list<Placement> placements)
      : spec_(Placements(placements)) {}
  PlanLayout(AliasPlacements alias) : spec_(std::move(alias)) {}
  PlanLayout(std::initializer_list<PlanDim> alias);

  bool is_alias() const { return std::holds_alternative<AliasPlacements>(spec_); }
  // The number of tensor dims the alias form fixes; -1 for placements.
  int64_t alias_ndim() const {
    return is_alias() ? static_cast<int64_t>(std::get<AliasPlacements>(spec_).size()) : -1;
  }

  // The Layout on `mesh` for a tensor of `tensor_ndim` dims (negative: not
  // known yet, checked later). ArgumentError, naming `what`, when the
  // placements do not match the mesh's dims, a mesh dim name is unknown, an
  // alias form has another number of entries than the tensor has dims, or a
  // shard dim is out of range.
  Layout resolve(const DeviceMeshPtr& mesh, int64_t tensor_ndim, const std::string& what) const;

  // "[S(0), R]" or "('None', 'tp')".
  std::string str() const;

 private:
  std::variant<Placements, AliasPlacements> spec_;
};

// The layouts of one module's inputs or outputs.
class ForwardLayouts {
 public:
  ForwardLayouts() = default;  // nothing to redistribute
  // One layout: the first input, or the only output.
  ForwardLayouts(PlanLayout layout) : positional_{std::move(layout)} {}
  ForwardLayouts(Placements placements)
      : positional_{PlanLayout(std::move(placements))} {}
  ForwardLayouts(std::initializer_list<Placement> placements)
      : positional_{PlanLayout(placements)} {}
  ForwardLayouts(std::initializer_list<PlanDim> alias)
      : positional_{PlanLayout(alias)} {}

  // One entry per position; nullopt leaves that value as it is.
  static ForwardLayouts positional(std::vector<std::optional<PlanLayout>> layouts);
  // Inputs by forward argument name; arguments not named are left alone.
  static ForwardLayouts by_name(std::map<std::string, PlanLayout> layouts);

  bool is_by_name() const { return by_name_.has_value(); }
  const std::vector<std::optional<PlanLayout>>& positional() const { return positional_; }
  const std::map<std::string, PlanLayout>& by_name() const { return *by_name_; }

 private:
  std::vector<std::optional<PlanLayout>> positional_;
  std::optional<std::map<std::string, PlanLayout>> by_name_;
};

struct ShardingPlan {
  // Parameter layouts by qualified name, as named_parameters() has them.
  std::map<std::string, PlanLayout> plan;
  // "<module>.input" or "input" -> the layouts its DTensor inputs take.
  std::map<std::string, ForwardLayouts> input_plan;
  // "<module>.output" or "output" -> the layouts its DTensor outputs take.
  std::map<std::string, ForwardLayouts> output_plan;
  // Submodules ("" is the module itself) whose DTensor outputs are returned
  // as local tensors (hp::to_local), after any output_plan layout.
  std::vector<std::string> return_local_tensor;
};

// The entries of `plan` that apply inside `part`, a module holding some of
// the modules of the model the plan was written for under that model's
// names (a pipeline stage, hp/pp/stage_module.h): the layouts of its
// parameters, the input and output layouts of its submodules and their
// local returns. shard_module wants every entry it is given found, so a
// part is sharded with its share of the plan. Entries for the model itself
// ("input", "output", "") are not a part's.
ShardingPlan plan_for_part(const ShardingPlan& plan, const torch::nn::Module& part);

}  // namespace hp
