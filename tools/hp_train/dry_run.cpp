#include "tools/hp_train/dry_run.h"

#include <variant>

#include <nlohmann/json.hpp>

#include "hp/plan/parallel_layout.h"
#include "hp/pp/stage_plan.h"
#include "hp/util/error.h"
#include "tools/hp_train/model.h"

namespace hp::train {

plan::PlanOptions plan_options(const TrainOptions& options, const Parallelism& parallelism,
                               int64_t vocab_size, int rank) {
  plan::PlanOptions p;
  // The model TrainModel::build gives.
  if (options.model == "llama") {
    p.model = llama_config(options, vocab_size);
  } else {
    HP_CHECK_ARG(options.model == "gpt", "--dry-run: --model '", options.model,
                 "' is not a model; expected gpt or llama");
    p.model = gpt_config(options, vocab_size);
  }
  p.layout = parallelism;
  p.rank = rank;
  p.batch_per_rank = options.batch / parallelism.dp_size();
  p.seq = options.seq;
  p.comm_fusion = options.comm_fusion;
  p.prefetch = options.prefetch;
  p.grad_clip = options.grad_clip > 0;
  p.checkpointing = options.activation_checkpointing == "blocks" ? plan::Checkpointing::kBlocks
                                                                 : plan::Checkpointing::kNone;
  return p;
}

plan::PipelinePlanOptions pipeline_plan_options(const TrainOptions& options,
                                                const Parallelism& parallelism,
                                                int64_t vocab_size, int rank) {
  const PipelineSchedule schedule = pipeline_schedule(options);
  plan::PipelinePlanOptions p;
  // The mesh is (dp, pp, tp), row-major (pipeline_run.cpp; hsdp's R x S
  // data-parallel ranks in place of dp): global rank (replica * P +
  // pipeline rank) * T + tp rank. The layout has no pp dim, so its rank is
  // (replica, tp rank) on its (dp, tp) mesh.
  const int64_t tp = parallelism.tp_size();  // 1 without a tp dim
  const int replica = static_cast<int>(rank / (schedule.ranks * tp));
  p.plan = plan_options(options, parallelism, vocab_size,
                        static_cast<int>(replica * tp + rank % tp));
  if (parallelism.mode == plan::ParallelMode::kHSDP || parallelism.ddp_stage_units) {
    // A rank of an hsdp stage holds what a rank of the stage sharded over
    // its S shard ranks holds: 1/S of the parameters, gradients and AdamW
    // state, the whole stage gathered through the step. Its one addition,
    // the all-reduce of the reduced gradient shards over the R replicas, is
    // in place (as the plain plan counts hsdp: hp/plan/fsdp_buffers.cpp).
    // So the stage is planned as fsdp over S, with hsdp's batch per rank
    // (B / (R x S), set above), the pipeline planner planning fsdp stages.
    // ddp's units (ddp_stage_units) are the same over R x 1.
    plan::ParallelLayout shards(plan::ParallelMode::kFSDP, {parallelism.shard_size()});
    shards.param_dtype = parallelism.param_dtype;
    shards.reduce_dtype = parallelism.reduce_dtype;
    p.plan.layout = shards;
    // Its place among the S ranks its stage is sharded over (which rows of
    // an uneven tensor it holds).
    p.plan.rank = static_cast<int>(parallelism.shard_rank(replica));
  }
  p.schedule = {pp::parse_schedule_kind(schedule.kind), static_cast<int>(schedule.ranks),
                static_cast<int>(schedule.stages_per_rank),
                static_cast<int>(schedule.microbatches)};
  p.pipeline_rank = static_cast<int>(rank / tp % schedule.ranks);
  const pp::ModelLayout layout =
      std::holds_alternative<nn::LlamaConfig>(p.plan.model)
          ? pp::llama_layout(std::get<nn::LlamaConfig>(p.plan.model))
          : pp::gpt_layout(std::get<nn::GPTConfig>(p.plan.model));
  const pp::StagePlan stages =
      pp::plan_stages(layout, pp::num_stages(p.schedule), options.pp_split);
  for (int s : pp::rank_stages(p.schedule, p.pipeline_rank)) {
    plan::PipelineStage stage;
    stage.modules = stages.stages.at(s);
    stage.first = s == 0;
    stage.last = s == stages.num_stages() - 1;
    for (const std::string& module : stage.modules) {
      for (size_t b = 0; b < layout.blocks.size(); ++b)
        if (layout.blocks[b] == module) stage.blocks.push_back(static_cast<int>(b));
    }
    p.stages.push_back(std::move(stage));
  }
  return p;
}

std::string plan_json(const plan::MemoryPlan& plan) {
  nlohmann::json out;
  out["rank"] = plan.rank;
  out["predicted_peak_bytes"] = plan.peak_bytes();
  const plan::StepPeak& peak = plan.peak();
  for (int i = 0; i < plan::kTermCount; ++i) {
    out[std::string(plan::term_name(static_cast<plan::Term>(i))) + "_bytes"] = peak.terms.bytes[i];
  }
  out["peak_at"] = peak.where;
  out["in_flight_bytes"] = peak.in_flight_bytes;
  out["steady_step_peak_bytes"] = plan.steady.terms.total();
  out["first_step_peak_bytes"] = plan.first_step.terms.total();
  out["between_steps_bytes"] = plan.between_steps_bytes;
  return out.dump();
}

}  // namespace hp::train
