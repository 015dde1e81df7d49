// hp-train --dry-run: the memory plan (P2, hp/plan/memory_plan.h) of each
// rank for the flags given, printed and optionally written as JSON, with no
// training step and no collective.
#pragma once

#include <cstdint>
#include <string>

#include "hp/plan/memory_plan.h"
#include "hp/plan/pipeline_plan.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {

// The plan's description of hp-train's run with these flags on `rank`:
// the model (vocabulary `vocab_size`), the mode and mesh, this rank's share
// of the global batch, the dtypes and fully_shard's flags.
plan::PlanOptions plan_options(const TrainOptions& options, const Parallelism& parallelism,
                               int64_t vocab_size, int rank);

// Under --pp: the plan of global rank `rank`'s pipeline rank (its stages,
// the schedule's row), its replica's share of the batch (docs/pipeline.md,
// "Memory plan"). --mode hsdp's stages are planned as sharded over their S
// shard ranks (fsdp over S: the replicas' all-reduce is in place).
plan::PipelinePlanOptions pipeline_plan_options(const TrainOptions& options,
                                                const Parallelism& parallelism,
                                                int64_t vocab_size, int rank);

// {"rank": r, "predicted_peak_bytes": ..., "parameters_bytes": ..., ...}: the
// peak step's terms, the steady and first steps' peaks and where they fall.
std::string plan_json(const plan::MemoryPlan& plan);

}  // namespace hp::train
