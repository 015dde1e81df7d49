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
// stages' state dicts: one dtype, every name (buffers too) one of
// `whole_model`'s, each held whole or as this rank's piece of a layout
// (fully_shard's shard, a tensor-parallel split, or both).
struct HeldParameter {
  at::Tensor param;   // the registered parameter: AdamW keys its state by it
  at::Tensor local;   // this rank's piece (outside autograd), when sharded
  Layout layout;      // how the stage's ranks hold it; undefined: whole here
  std::vector<int64_t> shape;

  bool sharded() const { return layout.defined(); }
};

struct HeldParameters {
  std::map<std::string, HeldParameter> by_name;
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
    std::map<std::string, HeldParameter> pieces;
    for (auto& [name, value] : get_model_state_dict(*stage)) {
      HeldParameter piece;
      if (std::holds_alternative<DTensor>(value)) {
        const DTensor& d = std::get<DTensor>(value);
        piece = {at::Tensor(), d.local(), d.layout(), d.sizes()};
      } else if (const at::Tensor& t = std::get<at::Tensor>(value); is_dtensor(t)) {
        piece = {at::Tensor(), local_of(t), layout_of(t), t.sizes().vec()};
      } else {
        piece.shape = t.sizes().vec();
      }
      const at::ScalarType type = piece.sharded() ? piece.local.scalar_type()
                                                  : std::get<at::Tensor>(value).scalar_type();
      auto it = known.find(name);
      HP_CHECK_ARG(it != known.end(), what, ": '", name, "' of stage ", stage->stage(),
                   " is not a parameter of the whole model's shapes (", whole_model.size(),
                   " of them); buffers cannot be declared on the other stages' ranks");
      HP_CHECK_ARG(piece.shape == it->second->shape, what, ": '", name, "' of stage ",
                   stage->stage(), " has shape ", to_string(piece.shape),
                   " but the whole model's shapes give ", to_string(it->second->shape));
      HP_CHECK_ARG(!dtype || *dtype == type, what, ": '", name, "' of stage ", stage->stage(),
                   " is ", type, " but other parameters are ", *dtype,
                   "; the other stages' keys are declared with one dtype");
      dtype = type;
      pieces.emplace(name, std::move(piece));
    }
    for (const auto& item : stage->named_parameters(/*recurse=*/true)) {
      auto it = pieces.find(item.key());
      HP_CHECK_ARG(it != pieces.end(), what, ": parameter '", item.key(), "' of stage ",
                   stage->stage(), " is missing from its state dict");
      it->second.param = item.value();
      HP_CHECK_ARG(held.by_name.emplace(item.key(), it->second).second, what, ": '", item.key(),
                   "' is held by two of this rank's stages");
    }
  }
  HP_CHECK_ARG(dtype.has_value(), what, ": this rank's stages hold no parameter");
  held.dtype = *dtype;
  return held;
}

// A piece `local` of a tensor held as `held` is, as a checkpoint entry,
// the whole tensor on each of the stage's ranks: gathered now over the
// layout's mesh (collective: the stage's ranks add the same keys in the
// same order), and after a load this rank's piece of it copied back.
void add_gathered(State& state, const std::string& key, const at::Tensor& local,
                  const HeldParameter& held, const std::vector<int>& holders) {
  FromLocalOptions shape;
  shape.shape = held.shape;  // uneven shards: the global shape, not inferred
  torch::NoGradGuard no_grad;
  at::Tensor whole = from_local(local, held.layout, shape).full_tensor().contiguous().clone();
  state.add_held_by(key, whole, holders);
  state.on_loaded([whole, local, layout = held.layout] {
    torch::NoGradGuard no_grad;
    local.copy_(distribute_tensor(whole, layout).local());
  });
}

// An optimizer state tensor of `held`'s parameter as this rank's piece.
at::Tensor piece_of(const at::Tensor& state_tensor) {
  return is_dtensor(state_tensor) ? local_of(state_tensor) : state_tensor;
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
    if (it != held.by_name.end() && it->second.sharded()) {
      add_gathered(state, prefix + p.name, it->second.local, it->second, holders.of(p.name));
    } else if (it != held.by_name.end()) {
      state.add_held_by(prefix + p.name, it->second.param, holders.of(p.name));
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
    const HeldParameter& h = it->second;
    auto& s = adamw_param_state(optimizer, h.param, amsgrad);
    if (h.sharded()) {
      add_gathered(state, base + ".exp_avg", piece_of(s.exp_avg()), h, ranks);
      add_gathered(state, base + ".exp_avg_sq", piece_of(s.exp_avg_sq()), h, ranks);
      if (amsgrad) add_gathered(state, base + ".max_exp_avg_sq", piece_of(s.max_exp_avg_sq()), h, ranks);
    } else {
      state.add_held_by(base + ".exp_avg", s.exp_avg(), ranks);
      state.add_held_by(base + ".exp_avg_sq", s.exp_avg_sq(), ranks);
      if (amsgrad) state.add_held_by(base + ".max_exp_avg_sq", s.max_exp_avg_sq(), ranks);
    }
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
