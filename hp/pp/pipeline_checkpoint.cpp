#include "hp/pp/pipeline_checkpoint.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <optional>

#include "hp/checkpoint/adamw_state.h"
#include "hp/checkpoint/consolidated.h"
#include "hp/fsdp/materialize.h"
#include "hp/fsdp/state_dict.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"

namespace hp::pp {

// The checkpoint layer's State, its helpers and load().
using namespace hp::checkpoint;
// The vector overloads beside hp::pp's own.
using hp::to_string;
namespace {

// This rank's stages' parameters by whole-model name, checked through the
// stages' state dicts: whole tensors (not sharded), one dtype, every name
// (buffers too) one of `whole_model`'s.
struct HeldParameters {
  std::map<std::string, at::Tensor> by_name;
  at::ScalarType dtype = at::kFloat;
};

HeldParameters held_parameters(const std::vector<pp::StageModule>& stages,
                               const std::vector<nn::ParameterShape>& whole_model,
                               const char* what) {
  HP_CHECK_ARG(!stages.empty(), what, ": this rank holds no stage");
  std::map<std::string, const nn::ParameterShape*> known;
  for (const nn::ParameterShape& p : whole_model) known.emplace(p.name, &p);
  HeldParameters held;
  std::optional<at::ScalarType> dtype;
  for (const pp::StageModule& stage : stages) {
    for (auto& [name, value] : get_model_state_dict(*stage)) {
      // A stage sharded within its ranks would need the other ranks to know
      // its layout to plan who writes which chunk: not supported.
      HP_CHECK_ARG(std::holds_alternative<at::Tensor>(value) &&
                       !is_dtensor(std::get<at::Tensor>(value)),
                   what, ": '", name, "' of stage ", stage->stage(),
                   " is sharded (fully_shard or tensor parallelism); a pipeline checkpoint holds "
                   "each stage's tensors whole on each of its ranks");
      const at::Tensor& tensor = std::get<at::Tensor>(value);
      auto it = known.find(name);
      HP_CHECK_ARG(it != known.end(), what, ": '", name, "' of stage ", stage->stage(),
                   " is not a parameter of the whole model's shapes (", whole_model.size(),
                   " of them); buffers cannot be declared on the other stages' ranks");
      HP_CHECK_ARG(tensor.sizes().vec() == it->second->shape, what, ": '", name, "' of stage ",
                   stage->stage(), " has shape ", to_string(tensor.sizes().vec()),
                   " but the whole model's shapes give ", to_string(it->second->shape));
      HP_CHECK_ARG(!dtype || *dtype == tensor.scalar_type(), what, ": '", name, "' of stage ",
                   stage->stage(), " is ", tensor.scalar_type(), " but other parameters are ",
                   *dtype, "; the other stages' keys are declared with one dtype");
      dtype = tensor.scalar_type();
    }
    // The parameters themselves, not the state dict's values: AdamW keys its
    // state by the parameter's tensor.
    for (const auto& item : stage->named_parameters(/*recurse=*/true)) {
      HP_CHECK_ARG(held.by_name.emplace(item.key(), item.value()).second, what, ": '", item.key(),
                   "' is held by two of this rank's stages");
    }
  }
  HP_CHECK_ARG(dtype.has_value(), what, ": this rank's stages hold no parameter");
  held.dtype = *dtype;
  return held;
}

}  // namespace

const std::vector<int>& StageHolders::of(const std::string& name) const {
  const int stage = plan.stage_of(name);
  HP_CHECK_ARG(stage >= 0, "pipeline checkpoint: no stage of ", describe(plan), " holds '", name,
               "'");
  HP_CHECK_ARG(static_cast<size_t>(stage) < ranks.size(), "pipeline checkpoint: stage ", stage,
               " holding '", name, "' has no ranks (", ranks.size(), " stages have)");
  return ranks[static_cast<size_t>(stage)];
}

StageHolders stage_holders(const pp::StagePlan& plan, const pp::ScheduleSpec& spec,
                           const pp::Transport& transport) {
  HP_CHECK_ARG(plan.num_stages() == pp::num_stages(spec), "stage_holders: the plan has ",
               plan.num_stages(), " stages but the schedule runs ", pp::num_stages(spec));
  HP_CHECK_ARG(transport.size() == spec.ranks, "stage_holders: the transport has ",
               transport.size(), " pipeline ranks but the schedule ", spec.ranks);
  StageHolders holders{plan, {}};
  for (int s = 0; s < plan.num_stages(); ++s) holders.ranks.push_back({transport.global_rank(pp::stage_rank(spec, s))});
  return holders;
}

void add_pipeline_model(State& state, const std::vector<pp::StageModule>& stages,
                        const StageHolders& holders,
                        const std::vector<nn::ParameterShape>& whole_model,
                        const std::string& prefix) {
  const HeldParameters held = held_parameters(stages, whole_model, "add_pipeline_model");
  for (const nn::ParameterShape& p : whole_model) {
    auto it = held.by_name.find(p.name);
    if (it != held.by_name.end()) {
      state.add_held_by(prefix + p.name, it->second, holders.of(p.name));
    } else {
      state.declare_held_by(prefix + p.name, p.shape, held.dtype, holders.of(p.name));
    }
  }
}

void add_pipeline_adamw(State& state, torch::optim::AdamW& optimizer,
                        const std::vector<pp::StageModule>& stages, const StageHolders& holders,
                        const std::vector<nn::ParameterShape>& whole_model,
                        const std::string& prefix) {
  const HeldParameters held = held_parameters(stages, whole_model, "add_pipeline_adamw");
  const bool amsgrad = adamw_uses_amsgrad(optimizer);
  std::vector<std::pair<torch::optim::AdamWParamState*, at::Tensor>> steps;
  for (const nn::ParameterShape& p : whole_model) {
    const std::string base = prefix + p.name;
    const std::vector<int>& ranks = holders.of(p.name);
    auto it = held.by_name.find(p.name);
    if (it == held.by_name.end()) {
      state.declare_held_by(base + ".exp_avg", p.shape, held.dtype, ranks);
      state.declare_held_by(base + ".exp_avg_sq", p.shape, held.dtype, ranks);
      if (amsgrad) state.declare_held_by(base + ".max_exp_avg_sq", p.shape, held.dtype, ranks);
      state.declare_held_by(base + ".step", {}, at::kLong, ranks);
      continue;
    }
    auto& s = adamw_param_state(optimizer, it->second, amsgrad);
    state.add_held_by(base + ".exp_avg", s.exp_avg(), ranks);
    state.add_held_by(base + ".exp_avg_sq", s.exp_avg_sq(), ranks);
    if (amsgrad) state.add_held_by(base + ".max_exp_avg_sq", s.max_exp_avg_sq(), ranks);
    at::Tensor step = torch::tensor(s.step(), torch::kLong);
    state.add_held_by(base + ".step", step, ranks);
    steps.emplace_back(&s, step);
  }
  state.on_loaded([steps] {
    for (const auto& [s, step] : steps) s->step(step.item<int64_t>());
  });
}

LoadResult load_into_stages(const std::vector<pp::StageModule>& stages, const StageHolders& holders,
                            const std::vector<nn::ParameterShape>& whole_model,
                            const std::string& path, const LoadIntoShardsOptions& options) {
  // The holders share their modules: a const holder still materialises them.
  for (const pp::StageModule& stage : stages) to_empty(*stage.ptr(), options.device);
  State state;
  if (std::filesystem::is_directory(path)) {
    add_pipeline_model(state, stages, holders, whole_model, options.checkpoint_prefix);
    LoadOptions load_options;
    load_options.strict = false;  // a checkpoint holds more than the model
    return load(state, path, load_options);
  }
  add_pipeline_model(state, stages, holders, whole_model, "");
  return import_consolidated(state, path, "", options.strict);
}

}  // namespace hp::pp
