// One pipeline rank's step replayed on a timeline (hp/plan/pipeline_plan.h;
// docs/pipeline.md, "Memory plan").
#include "hp/plan/pipeline_plan.h"

#include <algorithm>
#include <map>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hp/optim/fused_adamw.h"
#include "hp/plan/parameter_table.h"
#include "hp/plan/step_setup.h"
#include "hp/plan/step_simulator.h"
#include "hp/plan/timeline.h"
#include "hp/pp/lower.h"
#include "hp/pp/send_waits.h"
#include "hp/util/error.h"

namespace hp::plan {

namespace {

using detail::ActivationParts;
using detail::Id;
using detail::kFp32;
using detail::kFp64;
using detail::kInt64;
using detail::Timeline;

// Per stage, in bytes.
struct StageBytes {
  int64_t held = 0;       // the parameters' storage (their shards under fsdp)
  int64_t cast = 0;       // fsdp in bf16 with comm fusion: the shards' cast, beside them
  int64_t gathered = 0;   // fsdp: the unsharded parameters through the step
  int64_t grads = 0;      // the whole gradients the micro-batches accumulate
  int64_t reduced = 0;    // fsdp: the reduced gradient shards (what .grad holds)
  int64_t adam = 0;       // AdamW's two moments
  int64_t largest = 0;    // the largest gradient's elements (clip's fp64 copy)
  int64_t captured = 0;   // zero bubble: the gradients I captures for W, one micro-batch
};

struct Sizes {
  int64_t micro = 1;       // samples per micro-batch
  int64_t hidden = 0;      // one micro-batch's hidden states [B/M, T, d], compute dtype
  int64_t batch = 0;       // the replica's inputs and targets, int64
  ActivationParts parts;   // one micro-batch's activations (step_simulator.h)
};

// The gradients W needs that I computed (hp/pp/split_backward.h): each
// linear's output gradient, each norm's, per block; the head's logits'; in
// the compute dtype. Under tensor parallelism the column-parallel outputs
// are this rank's heads' or MLP width's; the row-parallel outputs and the
// norms' are whole.
int64_t captured_per_block(const detail::StepSetup& s, int64_t tokens) {
  const int64_t h = tokens * s.hidden * s.compute_dtype_size;
  if (!s.llama) return 7 * h / s.tp + 4 * h;  // c_attn 3h, c_fc 4h; both c_proj, two norms
  const int64_t kv = h * s.kv_heads / s.heads / s.tp;
  const int64_t mlp =
      tokens * detail::tp_piece(s.intermediate, s.tp, s.tp_rank) * s.compute_dtype_size;
  return h / s.tp + 2 * kv + 2 * mlp + 4 * h;  // q, k, v, gate, up; o, down, two norms
}

std::vector<StageBytes> stage_bytes(const PipelinePlanOptions& o, const detail::StepSetup& s,
                                    int64_t tokens) {
  // The parameters as this rank holds them: its tensor-parallel pieces,
  // which fully_shard (fsdp_tp) then splits over the data-parallel ranks.
  detail::ModelParameters model = detail::model_parameters(o.plan.model);
  if (s.tp > 1) detail::apply_tensor_parallel_plan(model, s.tp, s.tp_rank);
  // Mixed precision (fully_shard's units only): the parameters, their
  // reduced gradients and AdamW's moments stay fp32; the stage is gathered
  // in the compute dtype, and each micro-batch's gradient is added in the
  // reduce dtype into the whole gradient the step reduces (hp/fsdp's
  // pipeline step, as a no-sync backward keeps it); a reduce dtype other
  // than fp32 is cast into the parameter's fp32 pieces after the reduction.
  // With comm fusion over several ranks the shards' cast to the compute
  // dtype stays beside them (as in the plain plan: hp/plan/fsdp_buffers.cpp).
  const bool low_precision = s.compute_dtype_size != s.model_dtype_size;
  const bool sharded = o.plan.layout.uses_fully_shard() && s.shards > 1;
  const bool gathers = o.plan.layout.uses_fully_shard() && (sharded || low_precision);
  const bool cast_reduced = s.reduce_dtype_size != s.model_dtype_size;
  const int64_t D = s.shards;
  std::vector<StageBytes> out;
  for (const PipelineStage& stage : o.stages) {
    StageBytes b;
    auto add = [&](const detail::ParamShape& p) {
      const int64_t held = sharded ? p.padded(D) : p.numel();
      const int64_t local = sharded ? p.local(D, s.shard_rank) : p.numel();
      b.held += held * s.model_dtype_size;
      if (low_precision && sharded && o.plan.comm_fusion) b.cast += held * s.compute_dtype_size;
      b.adam += 2 * local * s.model_dtype_size;
      b.grads += p.numel() * s.reduce_dtype_size;
      if (gathers) {
        b.gathered += p.unsharded(D) * s.compute_dtype_size;
        b.reduced += cast_reduced ? local * s.model_dtype_size : held * s.reduce_dtype_size;
      }
      b.largest = std::max(b.largest, local);
    };
    for (const detail::ParamShape& p : model.root) {
      for (const std::string& module : stage.modules) {
        if (p.name.rfind(module + ".", 0) == 0) {
          add(p);
          break;
        }
      }
    }
    for (int block : stage.blocks) {
      HP_CHECK_ARG(block >= 0 && block < static_cast<int>(model.blocks.size()),
                   "plan_pipeline_memory: block ", block, " is not one of the model's ",
                   model.blocks.size());
      for (const detail::ParamShape& p : model.blocks[block]) add(p);
    }
    b.captured = static_cast<int64_t>(stage.blocks.size()) * captured_per_block(s, tokens);
    if (stage.first) b.captured += 2 * tokens * s.hidden * s.compute_dtype_size;
    if (stage.last) {
      b.captured +=
          tokens * (detail::tp_piece(s.vocab, s.tp, s.tp_rank) + s.hidden) * s.compute_dtype_size;
    }
    out.push_back(b);
  }
  return out;
}

// One step of the rank's lowered row on a timeline.
class RankStep {
 public:
  RankStep(const PipelinePlanOptions& o, const std::vector<StageBytes>& bytes, const Sizes& sizes,
           bool first_step)
      : o_(o), bytes_(bytes), z_(sizes), first_(first_step) {}

  // waits: the row's send_wait_points().
  StepPeak run(const std::vector<pp::Action>& row, const std::vector<int>& waits, bool sharded,
               bool replicas) {
    // Between steps: parameters, AdamW's moments and the last step's
    // gradients (steady), live when the step resets the peak.
    for (const StageBytes& b : bytes_) {
      t_.alloc(Term::kParameters, b.held);
      t_.alloc(Term::kCommunication, b.cast);
      if (!first_) {
        adam_.push_back(t_.alloc(Term::kOptimizer, b.adam));
        previous_grads_.push_back(t_.alloc(Term::kGradients, sharded ? b.reduced : b.grads));
      }
    }
    t_.at("start of the step");
    t_.start_peak();
    t_.free_all(previous_grads_);  // zero_grad(set_to_none)
    t_.at("the batch");
    t_.alloc(Term::kActivations, z_.batch);
    for (size_t i = 0; i < row.size(); ++i) act(row[i], static_cast<int>(i), waits.at(i), sharded);
    if (replicas) {
      // The replicas' average: the gradients concatenated into one buffer.
      t_.at("averaging the gradients over the replicas");
      int64_t all = 0;
      for (const StageBytes& b : bytes_) all += b.grads;
      t_.spike(Term::kCommunication, all);
    }
    // The step's state goes: the sends waited last, what the backwards left.
    for (auto& [index, ids] : due_) t_.free_all(ids);
    due_.clear();
    due_outputs_.clear();
    for (auto& [key, output] : outputs_) t_.free(output.id);
    outputs_.clear();
    t_.free_all(kept_);
    if (o_.plan.grad_clip) {
      t_.at("clip_grad_norm_");
      int64_t largest = 0;
      for (const StageBytes& b : bytes_) largest = std::max(largest, b.largest);
      t_.spike(Term::kSlack, largest * kFp64);
    }
    t_.at("optimizer step");
    const bool fused = optim::FusedAdamW::available();
    for (const StageBytes& b : bytes_) {
      if (first_) adam_.push_back(t_.alloc(Term::kOptimizer, b.adam));
      if (!fused) t_.spike(Term::kOptimizer, b.adam);
    }
    return t_.peak();
  }

  int64_t between_steps(bool sharded) const {
    int64_t sum = 0;
    for (const StageBytes& b : bytes_)
      sum += b.held + b.cast + b.adam + (sharded ? b.reduced : b.grads);
    return sum;
  }

 private:
  size_t local(int stage) const {
    for (size_t i = 0; i < o_.stages.size(); ++i)
      if (pp::rank_stages(o_.schedule, o_.pipeline_rank)[i] == stage) return i;
    return 0;
  }

  // A forward's rise above its start and what it leaves saved, the stage's
  // output (held apart: outputs_) included.
  std::pair<int64_t, int64_t> forward(const PipelineStage& stage) const {
    const ActivationParts& p = z_.parts;
    int64_t cur = 0, rise = 0;
    if (stage.first) {
      rise = p.embeddings.rise;
      cur = p.embeddings.saved;
    }
    for (size_t i = 0; i < stage.blocks.size(); ++i) {
      rise = std::max(rise, cur + p.block.rise);
      cur += p.block.saved;
    }
    if (stage.last) {
      rise = std::max(rise, cur + p.head.rise);
      cur += p.head.saved;
    }
    return {std::max(rise, cur), cur};
  }

  // A backward's rise above its start and its net change (negative: it
  // frees what the forward saved).
  std::pair<int64_t, int64_t> backward(const PipelineStage& stage) const {
    const ActivationParts& p = z_.parts;
    int64_t cur = 0, rise = 0;
    if (stage.last) {
      rise = p.head_backward.rise;
      cur = p.head_backward.saved;
    }
    for (size_t i = 0; i < stage.blocks.size(); ++i) {
      rise = std::max(rise, cur + p.block_backward.rise);
      cur += p.block_backward.saved;
    }
    if (stage.first) {
      rise = std::max(rise, cur + p.embeddings_backward.rise);
      cur += p.embeddings_backward.saved;
    } else {
      // The blocks' backwards free the stage's output among their saved
      // tensors, which the plan holds apart (outputs_): the input's
      // gradient takes its place.
      cur += z_.hidden;
    }
    return {rise, cur};
  }

  // a: the action at `index` of the row; wait_at: its send's wait point.
  void act(const pp::Action& a, int index, int wait_at, bool sharded) {
    const size_t i = local(a.stage);
    const PipelineStage& stage = o_.stages[i];
    const StageBytes& b = bytes_[i];
    const std::pair<int, int> key{a.stage, a.microbatch};
    t_.at(pp::to_string(a));
    // The sends this compute's receive proves done: their buffers go
    // before it computes (the executor waits them right after the receive).
    if (auto due = due_.find(index); due != due_.end()) {
      t_.free_all(due->second);
      due_.erase(due);
    }
    if (auto due = due_outputs_.find(index); due != due_outputs_.end()) {
      for (const auto& output : due->second) release_output(output);
      due_outputs_.erase(due);
    }
    // Frees `id` at wait point `at`, or at the step's end.
    auto free_at = [&](int at, Id id) {
      if (at == pp::kWaitAtStepEnd) {
        kept_.push_back(id);
      } else {
        due_[at].push_back(id);
      }
    };
    switch (a.op) {
      case pp::Op::kUnshard:
        if (sharded) gathered_[a.stage] = t_.alloc(Term::kParameters, b.gathered);
        return;
      case pp::Op::kReshard:
        return;
      case pp::Op::kReduceGrad:
        if (sharded) {
          // Each parameter resharded as its gradient is reduced into a shard.
          t_.free(gathered_[a.stage]);
          t_.spike(Term::kCommunication, b.reduced);
          t_.free(grads_[a.stage]);
          grads_[a.stage] = t_.alloc(Term::kGradients, b.reduced);
        }
        return;
      case pp::Op::kRecvF:
        // The received input: until the backward (or W) of its micro-batch.
        inputs_[key] = t_.alloc(Term::kActivations, z_.hidden);
        return;
      case pp::Op::kRecvB:
        recv_grad_[key] = t_.alloc(Term::kActivations, z_.hidden);
        return;
      case pp::Op::kSendF: {
        // The output's buffer, held by the send too until its wait point.
        Shared& output = outputs_.at(key);
        ++output.holders;
        if (wait_at != pp::kWaitAtStepEnd) due_outputs_[wait_at].push_back(key);
        return;
      }
      case pp::Op::kSendB:
        // The input's gradient: the payload, until the send's wait point.
        free_at(wait_at, take(grads_in_, key));
        return;
      case pp::Op::kForward: {
        const auto [rise, saved] = forward(stage);
        t_.spike(Term::kActivations, rise);
        const int64_t output = stage.last ? 0 : z_.hidden;
        saved_[key] = t_.alloc(Term::kActivations, saved - output);
        // The output, held by the micro-batch until its backward (or W).
        if (output > 0) outputs_[key] = Shared{t_.alloc(Term::kActivations, output), 1};
        // The previous stage on this rank handed its output over as this
        // stage's input, no copy: one more holder.
        if (on_this_rank(a.stage - 1)) ++outputs_.at({a.stage - 1, a.microbatch}).holders;
        return;
      }
      case pp::Op::kBackward:
      case pp::Op::kBackwardInput: {
        const bool split = a.op == pp::Op::kBackwardInput;
        if (!split) allocate_grads(a.stage, b);
        const auto [rise, change] = backward(stage);
        t_.spike(Term::kActivations, rise);
        Id saved = take(saved_, key);
        Id received_id = take(recv_grad_, key);
        const int64_t saved_bytes = bytes_of(saved);
        // The output's gradient: received, or handed over by the next stage
        // on this rank (freed with this backward).
        int64_t received = bytes_of(received_id);
        for (Id handed : handed_over_[key]) received += bytes_of(handed);
        // What is left: the input's gradient (sent, kept to the step's end).
        const int64_t left = std::max<int64_t>(0, saved_bytes + received + change);
        if (split) {
          // I keeps the graph, its saved tensors and the gradients it
          // captured for W.
          split_[key] = t_.alloc(Term::kActivations, b.captured);
          weight_saved_[key] = saved;
        } else {
          t_.free(saved);
        }
        t_.free(received_id);
        t_.free_all(handed_over_[key]);
        handed_over_.erase(key);
        // The input's gradient: sent (SEND_B), handed to the previous stage
        // on this rank (until its backward), or nothing to keep on stage 0.
        const Id grad_input = t_.alloc(Term::kActivations, left);
        if (on_this_rank(a.stage - 1)) {
          handed_over_[{a.stage - 1, a.microbatch}].push_back(grad_input);
        } else if (a.stage > 0) {
          grads_in_[key] = grad_input;
        } else {
          kept_.push_back(grad_input);
        }
        if (!split) release_inputs(a.stage, key);
        return;
      }
      case pp::Op::kBackwardWeight:
      {
        allocate_grads(a.stage, b);
        Id captured = take(split_, key), weight_saved = take(weight_saved_, key);
        t_.free(captured);
        t_.free(weight_saved);
        release_inputs(a.stage, key);  // the split held them until now
        return;
      }
    }
  }

  // The entry for `key`, removed; kNone when there is none.
  static Id take(std::map<std::pair<int, int>, Id>& ids, const std::pair<int, int>& key) {
    auto it = ids.find(key);
    if (it == ids.end()) return Timeline::kNone;
    const Id id = it->second;
    ids.erase(it);
    return id;
  }

  // After a micro-batch's backward (or W): its output and its input go
  // (the input being the previous stage's output when that stage is on this
  // rank), each when nothing else holds it.
  void release_inputs(int stage, const std::pair<int, int>& key) {
    release_output(key);
    Id received = take(inputs_, key);
    t_.free(received);
    if (on_this_rank(stage - 1)) release_output({stage - 1, key.second});
  }

  // Whether `stage` is one of the schedule's and held by this rank.
  bool on_this_rank(int stage) const {
    return stage >= 0 && stage < pp::num_stages(o_.schedule) &&
           pp::stage_rank(o_.schedule, stage) == o_.pipeline_rank;
  }

  void release_output(const std::pair<int, int>& key) {
    auto it = outputs_.find(key);
    if (it == outputs_.end()) return;  // the last stage's: the loss
    if (--it->second.holders == 0) {
      t_.free(it->second.id);
      outputs_.erase(it);
    }
  }

  void allocate_grads(int stage, const StageBytes& b) {
    if (grads_.count(stage) == 0) grads_[stage] = t_.alloc(Term::kGradients, b.grads);
  }

  int64_t bytes_of(Id id) const { return id == Timeline::kNone ? 0 : sizes_.at(id); }

  const PipelinePlanOptions& o_;
  const std::vector<StageBytes>& bytes_;
  const Sizes& z_;
  bool first_;
  // A timeline that remembers each block's size (bytes_of).
  struct SizedTimeline {
    Timeline t;
    std::map<Id, int64_t>* sizes;
    Id alloc(Term term, int64_t bytes) {
      const Id id = t.alloc(term, bytes);
      if (id != Timeline::kNone) (*sizes)[id] = bytes;
      return id;
    }
    void free(Id& id) { t.free(id); }
    void free_all(std::vector<Id>& ids) { t.free_all(ids); }
    void spike(Term term, int64_t bytes) { t.spike(term, bytes); }
    void at(std::string where) { t.at(std::move(where)); }
    void start_peak() { t.start_peak(); }
    const StepPeak& peak() const { return t.peak(); }
  };
  std::map<Id, int64_t> sizes_;
  SizedTimeline t_{Timeline(), &sizes_};
  // A buffer with several holders (a micro-batch's output: its backward,
  // its send, the next stage's input on this rank), freed by the last.
  struct Shared {
    Id id;
    int holders;
  };
  std::vector<Id> adam_, previous_grads_, kept_;
  std::map<int, Id> gathered_, grads_;
  std::map<std::pair<int, int>, Id> saved_, recv_grad_, split_, weight_saved_, inputs_, grads_in_;
  std::map<std::pair<int, int>, Shared> outputs_;
  std::map<std::pair<int, int>, std::vector<Id>> handed_over_;
  // Per wait point (a row index): the sent gradients and outputs it frees.
  std::map<int, std::vector<Id>> due_;
  std::map<int, std::vector<std::pair<int, int>>> due_outputs_;
};

// The most micro-batches a rank holds: from each F until its B (or W).
int peak_in_flight(const std::vector<pp::Action>& row) {
  int live = 0, peak = 0;
  for (const pp::Action& a : row) {
    if (a.op == pp::Op::kForward) peak = std::max(peak, ++live);
    if (a.op == pp::Op::kBackward || a.op == pp::Op::kBackwardWeight) --live;
  }
  return peak;
}

}  // namespace

PipelineMemoryPlan plan_pipeline_memory(const PipelinePlanOptions& o) {
  pp::check_spec(o.schedule);
  HP_CHECK_ARG(o.pipeline_rank >= 0 && o.pipeline_rank < o.schedule.ranks,
               "plan_pipeline_memory: pipeline rank ", o.pipeline_rank, " is outside the ",
               o.schedule.ranks, " ranks");
  const std::vector<int> stage_ids = pp::rank_stages(o.schedule, o.pipeline_rank);
  HP_CHECK_ARG(o.stages.size() == stage_ids.size(), "plan_pipeline_memory: pipeline rank ",
               o.pipeline_rank, " holds ", stage_ids.size(), " stages but ", o.stages.size(),
               " were described");
  const ParallelMode mode = o.plan.layout.mode;
  HP_CHECK_ARG(mode != ParallelMode::kHSDP, "plan_pipeline_memory: mode ", mode_name(mode),
               " inside pipeline stages is not planned (none, ddp, fsdp, tp or fsdp_tp)");
  // The stages fully_shard makes units of: fsdp and fsdp_tp, and tp with
  // units over one data-parallel rank (tp_units, which only cast).
  const bool units = mode == ParallelMode::kFSDP || mode == ParallelMode::kFSDPTP ||
                     (mode == ParallelMode::kTP && o.plan.layout.tp_units);
  HP_CHECK_ARG(o.plan.layout.param_dtype == Dtype::kFloat32 || units,
               "plan_pipeline_memory: mode ", mode_name(mode), " with param_dtype ",
               dtype_name(o.plan.layout.param_dtype),
               ": mixed precision needs fully_shard units (fsdp, fsdp_tp, tp with units)");
  const detail::StepSetup setup = detail::make_step_setup(o.plan);
  const int M = o.schedule.microbatches;
  HP_CHECK_ARG(o.plan.batch_per_rank % M == 0, "plan_pipeline_memory: the batch ",
               o.plan.batch_per_rank, " is not divisible by the ", M, " micro-batches");

  // One micro-batch through the whole model, planned as one process runs
  // it (or, in a tensor-parallel stage, as its tp rank runs it under --mode
  // tp: split widths, vocabulary-sharded logits, the all-reduces' buffers):
  // its activations part by part. fully_shard adds none of its own here:
  // the stages stay gathered through the step (the gathers are planned
  // below). In mixed precision, as one process whose units fully_shard
  // casts (fsdp over one rank): activations in the compute dtype, the
  // logits cast to fp32 for the loss (the pipeline's loss casts them as a
  // root's output_dtype would) and their gradient back.
  Sizes sizes;
  sizes.micro = o.plan.batch_per_rank / M;
  PlanOptions micro = o.plan;
  const bool low_precision = setup.compute_dtype_size != setup.model_dtype_size;
  if (o.plan.layout.tensor_parallel()) {
    micro.layout = ParallelLayout(ParallelMode::kTP, {setup.tp});
    micro.layout.tp_units = low_precision;
  } else if (low_precision) {
    micro.layout = ParallelLayout(ParallelMode::kFSDP, {1});
  } else {
    micro.layout = ParallelLayout();
  }
  micro.layout.param_dtype = o.plan.layout.param_dtype;
  micro.layout.reduce_dtype = o.plan.layout.reduce_dtype;
  micro.rank = setup.tp_rank;
  micro.batch_per_rank = sizes.micro;
  const detail::StepSetup micro_setup = detail::make_step_setup(micro);
  sizes.parts = detail::StepSimulator(micro_setup, /*first_step=*/false).activation_parts();
  const int64_t tokens = sizes.micro * o.plan.seq;
  sizes.hidden = tokens * setup.hidden * setup.compute_dtype_size;  // the boundaries' dtype
  sizes.batch = 2 * o.plan.batch_per_rank * o.plan.seq * kInt64;

  const std::vector<StageBytes> bytes = stage_bytes(o, setup, tokens);
  const bool replicas = mode == ParallelMode::kDDP && o.plan.layout.dp_size() > 1;
  const pp::Rows rows =
      pp::lower(o.schedule, pp::compute_rows(o.schedule), pp::LowerOptions{units});
  const std::vector<pp::Action>& row = rows.at(o.pipeline_rank);
  const std::vector<int> waits = pp::send_wait_points(o.schedule, rows).at(o.pipeline_rank);
  // fully_shard gathers a stage (and reduces its gradients) when it is
  // sharded or cast to the compute dtype.
  const bool gathers = units && (setup.shards > 1 || low_precision);

  PipelineMemoryPlan out;
  out.plan.rank = o.plan.rank;
  out.plan.steady = RankStep(o, bytes, sizes, false).run(row, waits, gathers, replicas);
  out.plan.first_step = RankStep(o, bytes, sizes, true).run(row, waits, gathers, replicas);
  out.plan.between_steps_bytes = RankStep(o, bytes, sizes, false).between_steps(gathers);
  out.peak_in_flight = peak_in_flight(pp::compute_rows(o.schedule).at(o.pipeline_rank));
  return out;
}

std::string describe_pipeline_rank(const PipelinePlanOptions& o, const PipelineMemoryPlan& plan) {
  const std::vector<int> ids = pp::rank_stages(o.schedule, o.pipeline_rank);
  std::string stages;
  bool consecutive = true;
  for (size_t i = 1; i < ids.size(); ++i) consecutive = consecutive && ids[i] == ids[i - 1] + 1;
  if (ids.size() == 1) {
    stages = fmt::format("stage {}", ids[0]);
  } else if (consecutive) {
    stages = fmt::format("stages {}-{}", ids.front(), ids.back());
  } else {
    stages = fmt::format("stages {}", fmt::join(ids, ", "));
  }
  std::vector<std::string> modules;
  for (const PipelineStage& s : o.stages)
    modules.insert(modules.end(), s.modules.begin(), s.modules.end());
  return fmt::format("rank {}: {} ({}), {} in flight", o.pipeline_rank, stages,
                     fmt::join(modules, " "),
                     plan.peak_in_flight == 1
                         ? std::string("1 micro-batch")
                         : fmt::format("{} micro-batches", plan.peak_in_flight));
}

}  // namespace hp::plan
