#include "tools/hp_train/dry_run.h"

#include <nlohmann/json.hpp>

#include "hp/util/error.h"
#include "tools/hp_train/model.h"

namespace hp::train {

namespace {

plan::Dtype plan_dtype(const std::string& name) {
  if (name == "bf16") return plan::Dtype::kBFloat16;
  if (name == "fp16") return plan::Dtype::kFloat16;
  return plan::Dtype::kFloat32;
}

// A mode the plan does not know yet is refused by name, not planned as
// another: a new mode adds its case here and its layout in the plan.
plan::ParallelMode plan_mode(Mode mode) {
  switch (mode) {
    case Mode::kNone: return plan::ParallelMode::kNone;
    case Mode::kFSDP: return plan::ParallelMode::kFSDP;
    case Mode::kHSDP: return plan::ParallelMode::kHSDP;
    case Mode::kDDP: return plan::ParallelMode::kDDP;
    case Mode::kTP: return plan::ParallelMode::kTP;
    case Mode::kFSDPTP: return plan::ParallelMode::kFSDPTP;
    default: break;
  }
  throw ArgumentError(cat("--dry-run: the memory plan does not cover --mode ", mode_name(mode),
                          " yet; expected none, fsdp, hsdp, ddp, tp or fsdp_tp"));
}

}  // namespace

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
  p.mode = plan_mode(parallelism.mode);
  p.mesh = parallelism.mesh_shape;
  if (parallelism.mode == Mode::kDDP) p.mesh = {parallelism.mesh_shape.at(0)};  // built as [N, 1]
  p.rank = rank;
  p.batch_per_rank = options.batch / parallelism.dp_size;
  p.seq = options.seq;
  p.param_dtype = plan_dtype(options.param_dtype);
  p.reduce_dtype = plan_dtype(options.reduce_dtype.empty() ? options.param_dtype
                                                            : options.reduce_dtype);
  p.comm_fusion = options.comm_fusion;
  p.prefetch = options.prefetch;
  p.reshard_after_forward = options.reshard_after_forward;
  p.grad_clip = options.grad_clip > 0;
  p.tp_units = parallelism.mode == Mode::kTP && !options.fully_shard_flags.empty();
  p.checkpointing = options.activation_checkpointing == "blocks" ? plan::Checkpointing::kBlocks
                                                                 : plan::Checkpointing::kNone;
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
