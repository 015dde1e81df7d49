// The pipeline executor (docs/pipeline.md): runs this rank's row of a
// schedule over its stages, once per training step.
//
//   hp::pp::ScheduleSpec spec{hp::pp::ScheduleKind::k1F1B, pp_size, 1, 8};
//   hp::pp::Pipeline pipeline({spec, config.n_embd}, my_stages, transport, loss);
//   for (...) {
//     optimizer.zero_grad();
//     at::Tensor loss = pipeline.step(ids, targets);   // defined on the last stage's rank
//     optimizer.step();
//   }
//
// A step splits the batch into the schedule's micro-batches along dim 0,
// runs this rank's actions in order (forward, backward or its input and
// weight halves, sends and receives of activations and of their gradients),
// and leaves in every parameter's .grad the gradient of the mean of the
// micro-batch losses, accumulated in micro-batch order: what one process
// computes with loss_k / M backward for k = 0 .. M-1. The loss is computed
// on the last stage only.
//
// fully_shard inside the stages (FSDP or HSDP over a data-parallel mesh
// dim, docs/pipeline.md): make each stage a fully_shard root (its blocks
// first, then the stage) before building the Pipeline, and the schedule
// gains each stage's UNSHARD before its first compute and RESHARD and
// REDUCE_GRAD after its last backward: the stage stays gathered across the
// step's micro-batches (FSDPModule::begin_pipeline_step, which states the
// memory that costs) and its gradients are reduced once per step. Every
// stage of a rank is a root, or none is (ArgumentError).
//
// Errors: bad input raises ArgumentError before anything is sent. A failure
// during a step (a dead or hung neighbour raises CollectiveError from its
// transfer, an exception in a stage's forward) propagates with the action
// that failed, its place in the row and the peer named, and leaves the
// pipeline unusable: its rows' positions no longer agree with the other
// ranks', so a later step raises UnusableError (rebuild the job; hprun's
// --max-restarts with --resume auto does that). Not thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/distributed/group.h"
#include "hp/pp/action.h"
#include "hp/pp/schedule.h"
#include "hp/pp/stage_module.h"
#include "hp/pp/transport.h"

namespace hp::pp {

struct PipelineOptions {
  ScheduleSpec schedule;
  // Stage boundaries carry hidden states [B / M, T, hidden_size] of
  // hidden_dtype on `device`.
  int64_t hidden_size = 0;
  at::ScalarType hidden_dtype = at::kFloat;
  c10::Device device = c10::Device(c10::DeviceType::CPU);
  // Replicas of this pipeline that train on other samples (data
  // parallelism across pipelines, each replica's stages whole): after the
  // step's last backward the stages' gradients are averaged over this
  // group, one all-reduce per dtype. Null or a group of one: none.
  // Stages sharded by fully_shard reduce over their own mesh instead (see
  // the Pipeline's comment) and refuse this.
  dist::GroupPtr data_parallel;
};

// loss(last stage's output for one micro-batch, its targets) -> a scalar,
// the micro-batch's mean loss. The output comes in the stage's compute
// dtype: the Pipeline calls a stage's forward itself, so a fully_shard
// root's output_dtype does not apply to it; under bf16 mixed precision the
// loss casts the logits to fp32 (logits.to(at::kFloat)) before reducing.
using PipelineLoss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& targets)>;

// Where one rank's wall time went in one step (Pipeline::record_step_stats):
// the measured bubble is 1 - compute_s / step_s. step_s - compute_s - wait_s
// is the executor's own time (posting transfers, bookkeeping).
struct StepStats {
  double step_s = 0;     // step(), call to return (with data_parallel, the gradients' average too)
  double compute_s = 0;  // the compute actions (F with the loss, B, I, W), their waits excluded
  double wait_s = 0;     // blocked on transfers: received inputs and gradients, the final sends
};

class Pipeline {
 public:
  // `stages`: this rank's stages, rank_stages(options.schedule, transport's
  // rank) in that order. Checks the schedule, the stages and the transport
  // (ArgumentError) and builds every rank's rows.
  Pipeline(PipelineOptions options, std::vector<StageModule> stages,
           std::shared_ptr<Transport> transport, PipelineLoss loss);
  ~Pipeline();

  // One step. `inputs` [B, T] token ids and `targets` [B, T]: stage 0's rank
  // reads the inputs, the last stage's rank the targets, every rank takes
  // the micro-batch shape from `inputs` (pass the same batch on every rank
  // of the pipeline; only the shapes must agree). B must be a multiple of
  // the micro-batch count. Returns the mean micro-batch loss on the rank of
  // the last stage, an undefined tensor elsewhere.
  at::Tensor step(const at::Tensor& inputs, const at::Tensor& targets);

  // Every rank's lowered rows; this rank runs rows()[rank()].
  const Rows& rows() const { return rows_; }
  int rank() const;
  const std::vector<StageModule>& stages() const { return stages_; }
  // The parameters of this rank's stages (for the optimizer).
  std::vector<at::Tensor> parameters() const;

  // Whether step() times its actions (off by default: two clock reads per
  // action and per wait when on, nothing when off). last_step_stats() is
  // the last step's figures while on, zeros before a timed step.
  void record_step_stats(bool on) { record_stats_ = on; }
  const StepStats& last_step_stats() const { return stats_; }

 private:
  struct StepState;
  void run_action(StepState& state, const Action& action);
  void agree_on_boundaries(StepState& state);
  void post_transfers(StepState& state, const std::vector<Action>& row, size_t begin, size_t end);
  at::Tensor hidden_buffer(const StepState& state) const;
  void average_gradients_over_replicas();
  StageModuleImpl& local_stage(int stage);
  StageModule& local_stage_module(int stage);
  // After a failed step: every stage's fully_shard pipeline step cancelled.
  void cancel_sharded_steps() noexcept;

  PipelineOptions options_;
  std::vector<StageModule> stages_;
  std::shared_ptr<Transport> transport_;
  PipelineLoss loss_;
  Rows rows_;
  std::vector<int> send_waits_;  // this rank's row: send_wait_points()
  std::string unusable_;  // why a failed step left the pipeline unusable
  bool sharded_ = false;  // the stages are fully_shard roots
  bool record_stats_ = false;
  StepStats stats_;
};

}  // namespace hp::pp
