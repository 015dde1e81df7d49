// What a pipeline-parallel job puts in a checkpoint (docs/design.md,
// "Pipeline checkpoints"): each rank's stages' parameters and AdamW state
// under the whole model's names, with every other stage's keys declared as
// held by that stage's ranks (checkpoint::State::declare_held_by). The checkpoint is then
// the one a whole model saves, key for key, so it loads at any pipeline
// degree, into a whole model in one process, or into stages again.
//
//   auto holders = hp::pp::stage_holders(plan, spec, *transport);
//   const auto shapes = config.parameter_shapes();              // the whole model's
//   hp::checkpoint::State state;
//   hp::pp::add_pipeline_model(state, pipeline.stages(), holders, shapes);
//   hp::pp::add_pipeline_adamw(state, optimizer, pipeline.stages(), holders, shapes);
//   hp::checkpoint::add_int(state, "train.step", step);
//   hp::checkpoint::save(state, dir, step);                     // or load(state, dir)
//
// Every rank builds the state from the same plan, holders and shapes, in
// the same order, so the states agree key for key (save and load check it,
// agreed). A stage sharded by fully_shard or tensor parallelism (DTensor
// parameters, or both) is saved as whole tensors too: adding its keys
// gathers each tensor over the stage's mesh (collective: every rank of the
// stage adds them in the same order), the lowest holder writes it, and
// after a load each rank copies its own piece back into its shard; the
// holders of such a stage are all the ranks that hold a piece of it (every
// dp and tp rank of its pipeline rank), and the gathered copies cost this
// rank's stages' whole size while the state lives. Every parameter of the whole model has the
// dtype of this rank's stages' parameters (one dtype; else ArgumentError).
// The model has no buffers (the GPT and the Llama have none): a stage's
// tensor that `whole_model` does not name is an ArgumentError.
#pragma once

#include <string>
#include <vector>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/load_into_shards.h"
#include "hp/checkpoint/state.h"
#include "hp/nn/parameter_shape.h"
#include "hp/pp/schedule.h"
#include "hp/pp/stage_module.h"
#include "hp/pp/stage_plan.h"
#include "hp/pp/transport.h"

namespace torch::optim {
class AdamW;
}

namespace hp::pp {

// Which global ranks hold each stage of a pipeline, whole.
struct StageHolders {
  StagePlan plan;
  std::vector<std::vector<int>> ranks;  // ranks[s]: the global ranks holding stage s

  // The holders of the parameter `name` (the stage plan.stage_of names);
  // ArgumentError when no stage owns it.
  const std::vector<int>& of(const std::string& name) const;
};

// Stage s is held by the global rank of pipeline rank stage_rank(spec,
// s) (transport.global_rank: a GroupTransport over the world group maps
// pipeline rank r to global rank r). ArgumentError when the plan's stage
// count is not the schedule's.
StageHolders stage_holders(const StagePlan& plan, const ScheduleSpec& spec,
                           const Transport& transport);

// Every parameter of `whole_model`, in its order, as `prefix` + its name:
// those of `stages` (this rank's stages) as their tensors, the others
// declared as held by their stage's ranks. load() writes the stages'
// parameters themselves.
void add_pipeline_model(checkpoint::State& state, const std::vector<StageModule>& stages,
                        const StageHolders& holders,
                        const std::vector<nn::ParameterShape>& whole_model,
                        const std::string& prefix = "model.");

// AdamW's state of every parameter of `whole_model` under its name, as
// add_adamw names it (`prefix` + name + ".exp_avg", ".exp_avg_sq",
// ".max_exp_avg_sq" with amsgrad, ".step"), in `whole_model`'s order: the
// state of `stages`' parameters (the optimizer must have been built from
// them; a parameter without state yet is given AdamW's initial state, as
// add_adamw does), the other stages' declared.
void add_pipeline_adamw(checkpoint::State& state, torch::optim::AdamW& optimizer,
                        const std::vector<StageModule>& stages, const StageHolders& holders,
                        const std::vector<nn::ParameterShape>& whole_model,
                        const std::string& prefix = "optim.");

// load_into_shards for a pipeline rank's stages: to_empty on each stage,
// then fills their parameters from `path`, a checkpoint directory or root
// saved at any pipeline degree (or by a whole model; options'
// checkpoint_prefix, other keys ignored) or a consolidated safetensors file
// of the whole model (its tensors are all declared, so `strict` holds).
// Collective over every rank of the job, with load()'s checks and errors.
checkpoint::LoadResult load_into_stages(const std::vector<StageModule>& stages,
                                        const StageHolders& holders,
                                        const std::vector<nn::ParameterShape>& whole_model,
                                        const std::string& path,
                                        const checkpoint::LoadIntoShardsOptions& options = {});

}  // namespace hp::pp
