// The memory plan (P2, hp/plan/memory_plan.h) of one pipeline rank: hp-train
// under --pp (docs/pipeline.md, "Memory plan"). Arithmetic on the shapes and
// the schedule's rows, nothing allocated or communicated.
//
// A pipeline rank holds its stages' parameters, their gradients and AdamW's
// moments (under --mode tp and fsdp_tp: its tensor-parallel pieces of them,
// the plain plan's local shapes; under fsdp and fsdp_tp: their shards over
// the data-parallel ranks, and through the step the gathered parameters and
// whole gradients), and the activations of the micro-batches in flight.
// The plan replays the rank's lowered row (hp/pp/lower.h) on a timeline: a
// forward adds what one micro-batch leaves saved through the stage's blocks
// (measured by the plain plan's step simulator, at the micro-batch's size,
// under --mode tp on the stage's tp ranks for a tensor-parallel stage: split
// widths, vocabulary-sharded logits and the all-reduces' buffers), a
// backward (or its input half) frees it; the boundary buffers (received
// hidden states, outputs and input gradients sent on: whole on every tp
// rank) live as the executor holds them, a sent one until its send's wait
// point (hp/pp/send_waits.h); between a zero-bubble I and its W the weight
// half's saved inputs and captured gradients stay. In mixed precision
// (fsdp, fsdp_tp, tp with units: fully_shard's casts) the gathers, the
// activations and the boundaries are in the compute dtype, the whole
// gradients in the reduce dtype, the rest fp32.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/plan/memory_plan.h"
#include "hp/pp/schedule.h"

namespace hp::plan {

// One stage as the pipeline rank holds it (hp/pp/stage_plan.h's StagePlan).
struct PipelineStage {
  std::vector<std::string> modules;  // in forward order, the whole model's names
  std::vector<int> blocks;           // the model's block indexes among them
  bool first = false;                // holds the embeddings
  bool last = false;                 // holds the final norm, the head and the loss
};

struct PipelinePlanOptions {
  // The model, seq, dtypes; layout: none, ddp ([D, 1]) or fsdp ([D]) over
  // the data-parallel ranks, tp ([T]) or fsdp_tp ([D, T]) (not hsdp: a
  // rank of an hsdp stage holds what one of fsdp over its S shard ranks
  // does, as hp-train plans it); rank: this rank on that mesh (dp rank * T + tp rank), without
  // the pipeline's dim; batch_per_rank: one replica's batch (B / D).
  PlanOptions plan;
  pp::ScheduleSpec schedule;
  int pipeline_rank = 0;
  std::vector<PipelineStage> stages;  // this rank's, rank_stages() order
};

struct PipelineMemoryPlan {
  MemoryPlan plan;
  // The most micro-batches whose forward ran on this rank and whose
  // backward (weight half included) has not, over all its stages.
  int peak_in_flight = 0;
};

// Throws hp::ArgumentError for options that describe no run (a stage list
// that is not rank_stages()'s, a bad schedule, what plan_memory refuses).
PipelineMemoryPlan plan_pipeline_memory(const PipelinePlanOptions& options);

// "rank 1: stages 2-3 (h.2 h.3 ln_f lm_head), 3 micro-batches in flight"
std::string describe_pipeline_rank(const PipelinePlanOptions& options,
                                   const PipelineMemoryPlan& plan);

}  // namespace hp::plan
