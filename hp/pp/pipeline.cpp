#include "hp/pp/pipeline.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <tuple>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/pp/lower.h"
#include "hp/pp/send_waits.h"
#include "hp/pp/split_backward.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/error.h"
#include "hp/util/trace.h"

namespace hp::pp {

// Ours and the vector overloads alike.
using hp::to_string;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// What crosses a stage boundary: a plain tensor. Under tensor parallelism
// the hidden states (and their gradients, and the loss) are DTensors
// replicated over the stage's tensor-parallel ranks; each rank passes its
// full value to its peer of the same tensor-parallel rank in the next
// stage, where a plain tensor mixed into the stage's DTensor ops counts as
// Replicate (docs/pipeline.md). A Partial value is reduced first, inside
// the tensor-parallel group, whose ranks all run the same action.
// Differentiable: the gradient flows back as a DTensor.
at::Tensor boundary_value(const at::Tensor& t) {
  return t.defined() && is_dtensor(t) ? full_tensor(t) : t;
}

bool is_transfer(Op op) {
  return op == Op::kSendF || op == Op::kRecvF || op == Op::kSendB || op == Op::kRecvB;
}

// Rethrows the exception in flight with `where` in front, keeping its kind.
[[noreturn]] void rethrow_with(const std::string& where) {
  try {
    throw;
  } catch (const ArgumentError& e) {
    throw ArgumentError(where + exception_message(e));
  } catch (const CollectiveError& e) {
    throw CollectiveError(where + exception_message(e));
  } catch (const UnusableError&) {
    throw;
  } catch (const std::exception& e) {
    throw std::runtime_error(where + exception_message(e));
  }
}

}  // namespace

// What one (stage, micro-batch) carries through a step.
struct MicroBatch {
  at::Tensor input;        // the stage's input: ids on stage 0, else a leaf
  at::Tensor output;       // the stage's output (its graph), or the loss on the last stage
  at::Tensor grad_output;  // the gradient of output (received, handed over, or ones)
  at::Tensor grad_input;   // the gradient of input, once backward produced it
  std::unique_ptr<SplitBackward> split;  // between I and W
  std::unique_ptr<TransferHandle> recv_input, recv_grad;
};

struct Pipeline::StepState {
  std::vector<at::Tensor> inputs, targets;  // per micro-batch
  std::vector<int64_t> hidden_shape;
  std::map<std::pair<int, int>, MicroBatch> micro;
  // Sends in flight and the tensors they read, each waited at its wait
  // point (send_waits.h: the row index of a compute, or kWaitAtStepEnd), so
  // a sent buffer goes during the step once the receiver has it.
  struct Send {
    std::unique_ptr<TransferHandle> handle;
    at::Tensor payload;
    int wait_at;
  };
  std::vector<Send> sends;
  int index = 0;  // the row index of the action running
  at::Tensor loss_sum;
};

Pipeline::Pipeline(PipelineOptions options, std::vector<StageModule> stages,
                   std::shared_ptr<Transport> transport, PipelineLoss loss)
    : options_(std::move(options)),
      stages_(std::move(stages)),
      transport_(std::move(transport)),
      loss_(std::move(loss)) {
  const ScheduleSpec& spec = options_.schedule;
  check_spec(spec);
  HP_CHECK_ARG(transport_ != nullptr, "Pipeline: transport must not be null");
  HP_CHECK_ARG(transport_->size() == spec.ranks, "Pipeline: the transport connects ",
               transport_->size(), " ranks but the schedule has ", spec.ranks, " pipeline ranks");
  HP_CHECK_ARG(static_cast<bool>(loss_), "Pipeline: loss must be set");
  HP_CHECK_ARG(!options_.data_parallel || options_.data_parallel->is_member(),
               "Pipeline: this process is not a member of data_parallel's ",
               options_.data_parallel ? options_.data_parallel->describe() : std::string());
  HP_CHECK_ARG(options_.hidden_size > 0, "Pipeline: hidden_size ", options_.hidden_size,
               " must be positive");
  const std::vector<int> expected = rank_stages(spec, transport_->rank());
  std::vector<int> got;
  for (const StageModule& s : stages_) {
    HP_CHECK_ARG(!s.is_empty(), "Pipeline: a stage module is null");
    HP_CHECK_ARG(s->num_stages() == num_stages(spec), "Pipeline: stage ", s->stage(),
                 " comes from a plan of ", s->num_stages(), " stages but the schedule runs ",
                 num_stages(spec), " (", spec.ranks, " ranks x ", spec.stages_per_rank,
                 " stages per rank)");
    got.push_back(s->stage());
  }
  HP_CHECK_ARG(got == expected, "Pipeline: pipeline rank ", transport_->rank(), " runs stages ",
               to_string(expected), " of the ", to_string(spec.kind), " schedule but was given ",
               to_string(got));
  // fully_shard inside the stages (docs/pipeline.md): every stage a root, or none.
  size_t roots = 0;
  for (const StageModule& s : stages_) {
    if (is_fully_sharded(*s)) {
      ++roots;
      continue;
    }
    for (const auto& sub : s->modules(/*include_self=*/false)) {
      auto hookable = std::dynamic_pointer_cast<nn::Module>(sub);
      HP_CHECK_ARG(!hookable || !is_fully_sharded(*hookable), "Pipeline: stage ", s->stage(),
                   " holds fully_shard unit ", hookable ? hookable->name() : std::string(),
                   " but is not a unit itself; call fully_shard on the stage module too, after "
                   "its blocks (it is the root the pipeline gathers and reduces as one)");
    }
  }
  HP_CHECK_ARG(roots == 0 || roots == stages_.size(), "Pipeline: ", roots, " of this rank's ",
               stages_.size(), " stages are fully_shard roots; shard all of them or none");
  sharded_ = roots > 0;
  HP_CHECK_ARG(!sharded_ || !options_.data_parallel || options_.data_parallel->size() == 1,
               "Pipeline: the stages are fully_shard units, which reduce their gradients over "
               "their own mesh; leave options.data_parallel unset (",
               options_.data_parallel ? options_.data_parallel->describe() : std::string(),
               " would average them a second time)");
  rows_ = lower(spec, compute_rows(spec), LowerOptions{sharded_});
  send_waits_ = send_wait_points(spec, rows_).at(transport_->rank());
}

Pipeline::~Pipeline() = default;

int Pipeline::rank() const { return transport_->rank(); }

std::vector<at::Tensor> Pipeline::parameters() const {
  std::vector<at::Tensor> params;
  for (const StageModule& s : stages_)
    for (const at::Tensor& p : s->parameters()) params.push_back(p);
  return params;
}

StageModuleImpl& Pipeline::local_stage(int stage) { return *local_stage_module(stage); }

StageModule& Pipeline::local_stage_module(int stage) {
  for (StageModule& s : stages_)
    if (s->stage() == stage) return s;
  throw ArgumentError(hp::cat("Pipeline: stage ", stage, " is not on pipeline rank ", rank()));
}

void Pipeline::cancel_sharded_steps() noexcept {
  if (!sharded_) return;
  for (StageModule& s : stages_) FSDPModule(s.ptr()).cancel_pipeline_step();
}

at::Tensor Pipeline::step(const at::Tensor& inputs, const at::Tensor& targets) {
  if (!unusable_.empty()) throw UnusableError(unusable_);
  const ScheduleSpec& spec = options_.schedule;
  const int M = spec.microbatches;
  const int last_stage = num_stages(spec) - 1;
  const bool has_first = stage_rank(spec, 0) == rank();
  const bool has_last = stage_rank(spec, last_stage) == rank();
  HP_CHECK_ARG(inputs.defined() && inputs.dim() == 2,
               "Pipeline::step: inputs must be [B, T] but got ",
               inputs.defined() ? inputs.sizes() : at::IntArrayRef{});
  const int64_t B = inputs.size(0), T = inputs.size(1);
  HP_CHECK_ARG(B % M == 0 && B > 0, "Pipeline::step: batch size ", B,
               " must be a positive multiple of the schedule's ", M, " micro-batches");
  if (has_last) {
    HP_CHECK_ARG(targets.defined() && targets.sizes() == inputs.sizes(),
                 "Pipeline::step: targets must have the inputs' shape ", inputs.sizes(),
                 " but got ", targets.defined() ? targets.sizes() : at::IntArrayRef{});
  }
  const bool timed = record_stats_;
  Clock::time_point step_start;
  if (timed) {
    stats_ = StepStats{};
    step_start = Clock::now();
  }
  StepState state;
  state.hidden_shape = {B / M, T, options_.hidden_size};
  if (has_first) state.inputs = inputs.chunk(M, 0);
  if (has_last) state.targets = targets.chunk(M, 0);

  try {
    agree_on_boundaries(state);
  } catch (...) {
    // The neighbours' steps cannot be told apart from this one's any more.
    unusable_ = hp::cat("pipeline rank ", rank(),
                        " failed to agree on its boundaries with its neighbours in an earlier "
                        "step; rebuild the pipeline (restart the job)");
    rethrow_with(hp::cat("Pipeline::step: pipeline rank ", rank(), " (global rank ",
                         transport_->global_rank(rank()), "): "));
  }
  const auto& row = rows_.at(rank());
  for (size_t i = 0; i < row.size(); ++i) {
    state.index = static_cast<int>(i);
    if (is_transfer(row[i].op)) {
      // A run of transfers is posted as one batch (coalesced on NCCL).
      size_t end = i;
      while (end < row.size() && is_transfer(row[end].op)) ++end;
      try {
        post_transfers(state, row, i, end);
      } catch (...) {
        std::string actions;
        for (size_t k = i; k < end; ++k) actions += (k > i ? ", " : "") + to_string(row[k]);
        const std::string where = hp::cat(
            "pipeline rank ", rank(), " (global rank ", transport_->global_rank(rank()),
            "), posting ", end - i == 1 ? "action " : "actions ", actions, " (#", i,
            end - i == 1 ? std::string() : hp::cat("-", end - 1), " of its ", row.size(),
            " actions): ");
        cancel_sharded_steps();
        unusable_ = where +
                    "failed in an earlier step; the ranks' schedules no longer agree, "
                    "rebuild the pipeline (restart the job)";
        rethrow_with(where);
      }
      i = end - 1;
      continue;
    }
    try {
      // Compute and the posting of transfers in lanes of their own; the
      // waits for a transfer inside a compute have theirs (run_action).
      const bool compute = is_compute(row[i].op);
      std::optional<trace::Span> span;
      if (trace::enabled()) {
        span.emplace(to_string(row[i]), compute ? "compute" : "comm",
                     compute ? "pipeline compute" : "pipeline p2p");
      }
      if (timed && compute) {
        // The waits for a received input inside it count as wait_s (run_action).
        const Clock::time_point start = Clock::now();
        const double waited = stats_.wait_s;
        run_action(state, row[i]);
        stats_.compute_s += seconds_since(start) - (stats_.wait_s - waited);
      } else {
        run_action(state, row[i]);
      }
    } catch (...) {
      const std::string where =
          hp::cat("pipeline rank ", rank(), " (global rank ", transport_->global_rank(rank()),
                  "), action ", to_string(row[i]), " (#", i, " of its ", row.size(), " actions): ");
      cancel_sharded_steps();  // the stages' fully_shard trees back to idle, resharded
      unusable_ = where +
                  "failed in an earlier step; the ranks' schedules no longer agree, "
                  "rebuild the pipeline (restart the job)";
      rethrow_with(where);
    }
  }
  try {
    trace::Span wait("wait for the sends", std::string(), "wait", "pipeline wait");
    const Clock::time_point start = timed ? Clock::now() : Clock::time_point();
    for (StepState::Send& send : state.sends) send.handle->wait();
    state.sends.clear();
    if (timed) stats_.wait_s += seconds_since(start);
  } catch (...) {
    cancel_sharded_steps();
    unusable_ = "a send of the pipeline failed in an earlier step; rebuild the pipeline";
    rethrow_with(hp::cat("pipeline rank ", rank(), ", waiting for its sends: "));
  }
  if (options_.data_parallel && options_.data_parallel->size() > 1) {
    try {
      average_gradients_over_replicas();
    } catch (...) {
      unusable_ = "averaging the gradients over the replicas failed in an earlier step; the "
                  "replicas' parameters may differ: rebuild the job";
      rethrow_with(hp::cat("pipeline rank ", rank(), ", averaging gradients over ",
                           options_.data_parallel->describe(), ": "));
    }
  }
  if (timed) stats_.step_s = seconds_since(step_start);
  return has_last ? boundary_value(state.loss_sum) : at::Tensor();
}

void Pipeline::average_gradients_over_replicas() {
  trace::Span span("average gradients", std::string(), "comm", "pipeline p2p");
  torch::NoGradGuard no_grad;
  // One flat buffer per dtype, in parameter order (the same on every
  // replica: the same stages), reduced by one all-reduce each.
  std::map<at::ScalarType, std::vector<at::Tensor>> by_dtype;
  for (const at::Tensor& p : parameters())
    if (p.grad().defined()) by_dtype[p.grad().scalar_type()].push_back(p.grad());
  for (auto& [dtype, grads] : by_dtype) {
    std::vector<at::Tensor> flat_views;
    for (const at::Tensor& g : grads) flat_views.push_back(g.reshape({-1}));
    at::Tensor flat = at::cat(flat_views);
    dist::all_reduce(*options_.data_parallel, flat, dist::ReduceOp::kAvg).wait();
    int64_t offset = 0;
    for (at::Tensor& g : grads) {
      g.copy_(flat.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
}

// Every neighbour this rank transfers to or from gets its boundary header:
// [B / M, T, hidden_size, hidden_dtype] as this rank derives them from its
// own inputs and options; each neighbour's must be the same, or the step
// stops here, before any activation moves, naming both ranks' shapes. A
// send's data and a receive's buffer would otherwise disagree in size (a
// transport error, or worse, a buffer read as another shape). The headers
// go both ways, so both ranks of a mismatched boundary fail with the same
// message; they travel under their own tag, so they never pair with an
// activation or a gradient. The waits here find the neighbours mostly
// there already: a pipeline rank later in the schedule ends its step
// earlier. On a GPU the comparison waits for the headers on the host, once
// per step, not per transfer: the host sizes the receives it posts next.
void Pipeline::agree_on_boundaries(StepState& state) {
  const ScheduleSpec& spec = options_.schedule;
  const int last_stage = num_stages(spec) - 1;
  std::vector<int> peers;
  for (const StageModule& stage : stages_) {
    for (int neighbour : {stage->stage() - 1, stage->stage() + 1}) {
      if (neighbour < 0 || neighbour > last_stage) continue;
      const int peer = stage_rank(spec, neighbour);
      if (peer != rank() && std::find(peers.begin(), peers.end(), peer) == peers.end())
        peers.push_back(peer);
    }
  }
  if (peers.empty()) return;
  std::vector<int64_t> mine = state.hidden_shape;
  mine.push_back(static_cast<int64_t>(options_.hidden_dtype));
  const at::Tensor header = at::tensor(mine, at::kLong).to(options_.device);
  std::vector<std::pair<int, at::Tensor>> theirs;
  std::vector<std::unique_ptr<TransferHandle>> receives;
  for (int peer : peers) {
    theirs.emplace_back(peer, at::empty_like(header));
    receives.push_back(transport_->recv(theirs.back().second, peer, kHeaderTag));
    state.sends.push_back({transport_->send(header, peer, kHeaderTag), header, kWaitAtStepEnd});
  }
  auto describe = [](const at::Tensor& h) {
    const at::Tensor cpu = h.cpu();
    const int64_t* v = cpu.data_ptr<int64_t>();
    const int64_t dtype = v[3];
    const bool known = dtype >= 0 && dtype < static_cast<int64_t>(at::ScalarType::NumOptions);
    return hp::cat("[", v[0], ", ", v[1], ", ", v[2], "] ",
                   known ? std::string(c10::toString(static_cast<at::ScalarType>(dtype)))
                         : hp::cat("(dtype code ", dtype, ")"));
  };
  for (size_t i = 0; i < peers.size(); ++i) {
    receives[i]->wait();
    HP_CHECK_ARG(at::equal(theirs[i].second, header), "its micro-batches' hidden states are ",
                 describe(header), " ([B / M, T, hidden_size] hidden_dtype, from inputs [",
                 state.hidden_shape[0] * spec.microbatches, ", ", state.hidden_shape[1], "] in ",
                 spec.microbatches, " micro-batches) but its neighbour, pipeline rank ", peers[i],
                 " (global rank ", transport_->global_rank(peers[i]), "), expects ",
                 describe(theirs[i].second),
                 "; every pipeline rank's step takes inputs of the same [B, T] and its "
                 "PipelineOptions the same hidden_size and hidden_dtype");
  }
}

at::Tensor Pipeline::hidden_buffer(const StepState& state) const {
  return at::empty(state.hidden_shape,
                   at::TensorOptions(options_.hidden_dtype).device(options_.device));
}

// The transfers row[begin, end) posted together: a receive allocates its
// buffer (kept by its micro-batch, whose compute waits for it), a send
// takes its payload (the output, or the input's gradient, which its
// micro-batch lets go) and joins the sends in flight with its wait point.
void Pipeline::post_transfers(StepState& state, const std::vector<Action>& row, size_t begin,
                              size_t end) {
  const ScheduleSpec& spec = options_.schedule;
  std::vector<Transfer> batch;
  std::vector<std::unique_ptr<TransferHandle>*> receive_slots;  // null for a send
  std::vector<std::unique_ptr<TransferHandle>> handles;
  for (size_t i = begin; i < end; ++i) {
    const Action& a = row[i];
    // Each action's span on the p2p lane, as --trace shows the row; the
    // batch is posted inside the last one.
    std::optional<trace::Span> span;
    if (trace::enabled()) span.emplace(to_string(a), "comm", "pipeline p2p");
    MicroBatch& mb = state.micro[{a.stage, a.microbatch}];
    switch (a.op) {
      case Op::kRecvF:
        mb.input = hidden_buffer(state);
        batch.push_back({false, mb.input, stage_rank(spec, a.stage - 1), kActivationTag});
        receive_slots.push_back(&mb.recv_input);
        break;
      case Op::kRecvB:
        mb.grad_output = hidden_buffer(state);
        batch.push_back({false, mb.grad_output, stage_rank(spec, a.stage + 1), kGradientTag});
        receive_slots.push_back(&mb.recv_grad);
        break;
      case Op::kSendF:
        batch.push_back({true, mb.output.detach().contiguous(), stage_rank(spec, a.stage + 1),
                         kActivationTag});
        receive_slots.push_back(nullptr);
        break;
      case Op::kSendB:
        HP_CHECK_ARG(mb.grad_input.defined(),
                     "SEND_B before the backward of the same micro-batch");
        batch.push_back({true, mb.grad_input.contiguous(), stage_rank(spec, a.stage - 1),
                         kGradientTag});
        mb.grad_input = at::Tensor();
        receive_slots.push_back(nullptr);
        break;
      default:
        throw std::logic_error(hp::cat("Pipeline: ", to_string(a), " is no transfer"));
    }
    if (i + 1 == end) handles = transport_->post(batch);
  }
  for (size_t k = 0; k < batch.size(); ++k) {
    if (receive_slots[k] != nullptr) {
      *receive_slots[k] = std::move(handles.at(k));
    } else {
      state.sends.push_back({std::move(handles.at(k)), batch[k].tensor,
                             send_waits_.at(begin + k)});
    }
  }
}

void Pipeline::run_action(StepState& state, const Action& action) {
  const ScheduleSpec& spec = options_.schedule;
  const int s = action.stage, k = action.microbatch;
  const int last_stage = num_stages(spec) - 1;
  MicroBatch& mb = state.micro[{s, k}];
  auto previous_is_local = [&] { return s > 0 && stage_rank(spec, s - 1) == rank(); };
  auto next_is_local = [&] { return s < last_stage && stage_rank(spec, s + 1) == rank(); };
  // A receive's wait, timed into stats_.wait_s when the step is timed, then
  // the waits of the sends the receive proves done (they return at once),
  // whose buffers go.
  auto wait_for = [&](TransferHandle& handle) {
    const Clock::time_point start = record_stats_ ? Clock::now() : Clock::time_point();
    handle.wait();
    auto due = std::stable_partition(state.sends.begin(), state.sends.end(),
                                     [&](const StepState::Send& send) {
                                       return send.wait_at != state.index;
                                     });
    for (auto it = due; it != state.sends.end(); ++it) it->handle->wait();
    state.sends.erase(due, state.sends.end());
    if (record_stats_) stats_.wait_s += seconds_since(start);
  };
  // The gradient of the stage's output, before its backward.
  auto take_grad_output = [&]() -> at::Tensor {
    if (s == last_stage) return at::ones_like(mb.output);
    if (next_is_local()) {
      MicroBatch& next = state.micro.at({s + 1, k});
      at::Tensor g = std::move(next.grad_input);
      return g;
    }
    HP_CHECK_ARG(mb.recv_grad != nullptr, "no RECV_B was posted before this backward");
    std::optional<trace::Span> wait;  // named only when recorded: once per micro-batch
    if (trace::enabled())
      wait.emplace("wait for " + to_string(Action{s, Op::kRecvB, k}), "wait", "pipeline wait");
    wait_for(*mb.recv_grad);
    mb.recv_grad.reset();
    return mb.grad_output;
  };
  auto stage_params = [&](StageModuleImpl& stage) {
    std::vector<at::Tensor> params;
    for (const at::Tensor& p : stage.parameters())
      if (p.requires_grad()) params.push_back(p);
    return params;
  };

  switch (action.op) {
    case Op::kRecvF:
    case Op::kRecvB:
    case Op::kSendF:
    case Op::kSendB:
      throw std::logic_error(hp::cat("Pipeline: ", to_string(action),
                                     " runs in a batch of transfers (post_transfers)"));
    case Op::kForward: {
      StageModuleImpl& stage = local_stage(s);
      at::Tensor input;
      if (s == 0) {
        input = state.inputs.at(k);
      } else if (previous_is_local()) {
        input = state.micro.at({s - 1, k}).output.detach().requires_grad_(true);
      } else {
        HP_CHECK_ARG(mb.recv_input != nullptr, "no RECV_F was posted before this forward");
        std::optional<trace::Span> wait;
        if (trace::enabled())
          wait.emplace("wait for " + to_string(Action{s, Op::kRecvF, k}), "wait", "pipeline wait");
        wait_for(*mb.recv_input);
        mb.recv_input.reset();
        input = mb.input.requires_grad_(true);
      }
      mb.input = input;
      at::Tensor output = stage.forward(input);
      if (s == last_stage) {
        at::Tensor loss = loss_(output, state.targets.at(k)) / spec.microbatches;
        state.loss_sum = state.loss_sum.defined() ? state.loss_sum + loss.detach() : loss.detach();
        mb.output = loss;
      } else {
        mb.output = boundary_value(output);
      }
      return;
    }
    case Op::kBackward: {
      at::Tensor grad = take_grad_output();
      torch::autograd::backward({mb.output}, {grad});
      if (s > 0) mb.grad_input = boundary_value(mb.input.grad());
      // The received input and the output go now (the output's buffer when
      // its send is done too): only the input's gradient stays, until sent.
      mb.input = at::Tensor();
      mb.output = at::Tensor();
      mb.grad_output = at::Tensor();
      return;
    }
    case Op::kBackwardInput: {
      at::Tensor grad = take_grad_output();
      StageModuleImpl& stage = local_stage(s);
      mb.split = std::make_unique<SplitBackward>(mb.output, s > 0 ? mb.input : at::Tensor(),
                                                 stage_params(stage));
      at::Tensor grad_input = mb.split->backward_input(grad);
      if (s > 0) mb.grad_input = boundary_value(grad_input);
      // The split keeps the input and the output until W.
      mb.input = at::Tensor();
      mb.output = at::Tensor();
      mb.grad_output = at::Tensor();
      return;
    }
    case Op::kBackwardWeight:
      HP_CHECK_ARG(mb.split != nullptr, "W before the I of the same micro-batch");
      mb.split->backward_weight();
      mb.split.reset();
      return;
    case Op::kUnshard:
      // Gathered until REDUCE_GRAD, across the step's micro-batches.
      FSDPModule(local_stage_module(s).ptr()).begin_pipeline_step();
      return;
    case Op::kReshard:
      // Nothing of its own: at REDUCE_GRAD each parameter is resharded as its
      // gradient is reduced (its unsharded buffer lent to the reduce-scatter),
      // so the parameters go before the reductions allocate, as here.
      return;
    case Op::kReduceGrad:
      FSDPModule(local_stage_module(s).ptr()).finish_pipeline_step();
      return;
  }
}

}  // namespace hp::pp
