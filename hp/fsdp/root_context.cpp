#include "hp/fsdp/root_context.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/torch.h>

#include <algorithm>

#include "hp/fsdp/hook_check.h"
#include "hp/fsdp/unit.h"
#include "hp/util/trace.h"

namespace hp::fsdp {

// Held by the end-of-backward callback. torch's engine destroys the queued
// callbacks of a backward that raised without running them; the guard's
// destructor is how the tree learns that its backward was abandoned.
struct RootContext::EndOfBackwardGuard {
  std::weak_ptr<RootContext> context;
  bool finished = false;
  ~EndOfBackwardGuard() {
    if (finished) return;
    if (auto c = context.lock()) c->abandon_backward();
  }
};

std::shared_ptr<RootContext> RootContext::create(Unit& root) {
  auto context = std::make_shared<RootContext>();
  context->root_ = &root;
  context->units_.push_back(root.weak_from_this());
  // Units its forward could never reach through their hooks, found before
  // any gather (hook_check.h).
  check_units_called_through_hooks(root.modules());
  std::vector<std::shared_ptr<Unit>> joining;
  for (auto& module : root.modules()) {
    for (auto& unit : units_in_tree(*module, /*include_self=*/false)) {
      if (unit.get() == &root) continue;
      if (std::find(joining.begin(), joining.end(), unit) != joining.end()) continue;
      HP_CHECK_ARG(unit->state_ == Unit::State::kIdle, "fully_shard: unit ", unit->name(),
                   " is in the middle of a forward/backward pass of another root; run the "
                   "outermost module's forward instead");
      joining.push_back(unit);
    }
  }
  for (auto& unit : joining) unit->validate_for_training();
  root.validate_for_training();
  // Checked: join. A set_is_last_backward(false) on any unit of the tree
  // before its root existed holds for the tree.
  context->is_last_backward_ = root.is_last_backward_before_root();
  for (auto& unit : joining) {
    unit->context_ = context;
    context->units_.push_back(unit);
    context->is_last_backward_ = context->is_last_backward_ && unit->is_last_backward_before_root();
  }
  return context;
}

namespace {

void record_once(std::vector<Unit*>& order, Unit* unit) {
  if (std::find(order.begin(), order.end(), unit) == order.end()) order.push_back(unit);
}

Unit* neighbour(const std::vector<Unit*>& order, const Unit* unit, int offset) {
  auto it = std::find(order.begin(), order.end(), unit);
  if (it == order.end()) return nullptr;
  const auto index = (it - order.begin()) + offset;
  if (index < 0 || index >= static_cast<int64_t>(order.size())) return nullptr;
  return order[index];
}

}  // namespace

void RootContext::record_forward(Unit* unit) {
  if (!forward_order_recorded_) record_once(forward_order_, unit);
}

void RootContext::record_post_forward(Unit* unit) {
  if (!forward_order_recorded_) record_once(post_forward_order_, unit);
}

Unit* RootContext::next_in_forward(const Unit* unit) const {
  return neighbour(forward_order_, unit, +1);
}

Unit* RootContext::next_in_backward(const Unit* unit) const {
  return neighbour(post_forward_order_, unit, -1);
}

void RootContext::check_hooks_ran(const nn::TensorList& outputs) {
  if (hooks_checked_ || !at::GradMode::is_enabled() ||
      std::none_of(outputs.begin(), outputs.end(),
                   [](const at::Tensor& t) { return t.defined() && t.requires_grad(); })) {
    return;
  }
  std::vector<std::shared_ptr<Unit>> units;
  for (auto& weak : units_) {
    if (auto unit = weak.lock()) units.push_back(std::move(unit));
  }
  check_units_ran(root_->modules(), units, ran_, outputs);
  hooks_checked_ = true;
  ran_.clear();
}

void RootContext::ensure_end_of_backward() {
  if (backward_in_flight_) return;
  check_accumulates();
  auto guard = std::make_shared<EndOfBackwardGuard>();
  guard->context = weak_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([guard] {
    auto context = guard->context.lock();
    if (!context) {
      guard->finished = true;
      return;
    }
    // On an exception the guard is not marked finished: autograd drops the
    // callback, and the guard's destructor abandons this backward.
    context->finish_backward();
    guard->finished = true;
  });
  backward_in_flight_ = true;
}

void RootContext::check_accumulates() {
  // A unit reduces a parameter's gradient in the post-hook of the
  // parameter's gradient accumulator. torch::autograd::grad never runs the
  // accumulators of its inputs: it returns what flows into them, which for
  // a managed parameter is this rank's own gradient of the unsharded
  // parameter, unreduced, and nothing would say so. The engine decided what
  // it runs before running anything: its exec_info (empty for a backward()
  // that runs every node) marks such an input's accumulator as captured but
  // not needed. This runs at the first unit's pre-backward, before any
  // gather or reduction of this backward, and every rank's engine decided
  // the same, so every rank raises here. Gradients of other inputs (a
  // gradient penalty's d loss / d x) leave the accumulators alone and pass.
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info == nullptr || exec_info->empty()) return;
  std::vector<std::string> captured;  // "unit: parameter"
  for (auto& weak : units_) {
    auto unit = weak.lock();
    if (!unit) continue;
    for (const auto& p : unit->params()) {
      torch::autograd::Node* accumulator = p->grad_accumulator();
      if (accumulator == nullptr) continue;
      auto it = exec_info->find(accumulator);
      if (it == exec_info->end() || it->second.needed_ || !it->second.captures_) continue;
      captured.push_back(cat(unit->name(), ": ", p->fqn()));
    }
  }
  if (captured.empty()) return;
  // Nothing of this backward has happened yet: every unit back to idle and
  // resharded, as after a failed forward, with every gradient as it was.
  reset_units(/*drop_grads=*/false);
  throw_argument_error(cat(
      "fully_shard: torch::autograd::grad was asked for the gradients of parameters that "
      "fully_shard units manage ", to_string(captured), "; it does not accumulate them into "
      ".grad, and a unit reduces (reduce-scatters, all-reduces) a gradient as it accumulates, "
      "so the result would be this rank's unreduced gradient of the unsharded parameter. Use "
      "hp::parallelize_value_and_grad, which returns the reduced gradient shards and leaves "
      ".grad alone, or backward(), which leaves them in .grad"));
}

void RootContext::begin_pipeline_step() {
  check_usable();
  HP_CHECK_ARG(!pipeline_step_, "begin_pipeline_step: the units of ", root_->name(),
               " are already in a pipeline step; call finish_pipeline_step() (or "
               "cancel_pipeline_step()) first");
  std::vector<std::shared_ptr<Unit>> units;
  for (auto& weak : units_) {
    auto unit = weak.lock();
    if (!unit) continue;
    HP_CHECK_ARG(unit->state_ == Unit::State::kIdle, "begin_pipeline_step: unit ", unit->name(),
                 " is in the middle of a forward or backward; begin the pipeline step before "
                 "the step's first forward and after the last backward of the one before");
    units.push_back(std::move(unit));
  }
  try {
    // Reductions left by set_is_last_backward(false) land first, as at a
    // root's forward; then every gather is issued before any is waited for.
    begin_iteration(root_->compute_device());
    for (auto& unit : units) {
      trace::Span span("unshard ", unit->name(), "fsdp", "compute");
      unit->begin_unshard();
    }
    for (auto& unit : units) unit->wait_unshard();
  } catch (const CollectiveError&) {
    mark_unusable("the gathers of a pipeline step", std::current_exception());
    reset_units(/*drop_grads=*/false);
    throw;
  } catch (...) {
    reset_units(/*drop_grads=*/false);
    throw;
  }
  for (auto& unit : units) unit->enter_pipeline_step();
  pipeline_step_ = true;
}

void RootContext::finish_pipeline_step() {
  HP_CHECK_ARG(pipeline_step_, "finish_pipeline_step: the units of ", root_->name(),
               " are not in a pipeline step (begin_pipeline_step() starts one)");
  check_usable();
  pipeline_step_ = false;
  backward_in_flight_ = true;
  try {
    for (auto& weak : units_) {
      if (auto unit = weak.lock()) unit->reduce_pipeline_grads();
    }
    finish_backward();
  } catch (...) {
    // As a backward that raised: what was issued is waited for, the
    // gradients (partial) dropped, every unit resharded and idle; a
    // collective failure has made the tree unusable already.
    abandon_backward();
    throw;
  }
}

void RootContext::cancel_pipeline_step() noexcept {
  if (!pipeline_step_) return;
  pipeline_step_ = false;
  std::vector<std::shared_ptr<Unit>> units;
  for (auto& weak : units_) {
    if (auto unit = weak.lock()) units.push_back(std::move(unit));
  }
  // The step's whole gradients go before the parameters are resharded (a
  // gradient must match its parameter's shape), the stashed ones come back
  // after.
  for (auto& unit : units) {
    for (auto& p : unit->params()) {
      p->param().mutable_grad() = at::Tensor();
      p->restore_remembered_kept_grad();  // the micro-batches' kept in the reduce dtype go too
    }
  }
  reset_units(/*drop_grads=*/false);
  for (auto& unit : units) {
    for (auto& p : unit->params()) {
      try {
        p->restore_stash();
      } catch (...) {
        p->zero_grad();  // what cannot come back is dropped whole, never half
      }
    }
  }
  release_stream_buffers();
}

void RootContext::begin_iteration(c10::Device device) {
  if (!comm_) comm_ = std::make_unique<CommContext>(device);
  if (!reductions_.empty() && comm_->streams()) comm_->streams()->on_mark("pending gradients");
  reductions_.complete_all();
  comm_->release_reduce_scatter_inputs("pending gradients");
  comm_->finish_offload_copies();
  comm_->begin_iteration();
}

void RootContext::finish_backward() {
  try {
    for (auto& weak : units_) {
      if (auto unit = weak.lock()) unit->finish_backward();
    }
    if (comm_ && comm_->streams()) comm_->streams()->on_mark("end of backward");
    if (is_last_backward_) reductions_.complete_all();
    if (comm_) {
      comm_->release_all_gather_output();
      if (is_last_backward_) comm_->release_reduce_scatter_inputs("end of backward");
      comm_->finish_offload_copies();
    }
  } catch (const CollectiveError&) {
    mark_unusable("the end of backward", std::current_exception());
    throw;
  }
  backward_in_flight_ = false;
  next_wave_ = 0;
}

void RootContext::wait_for_gradients() {
  check_usable();
  // Inside a backward the pending reductions are the pipeline's (reduction.h):
  // completing them there would serialise it, and the gradients of units
  // still to run would not be among them.
  HP_CHECK_ARG(!backward_in_flight_, "wait_for_gradients: called during a backward of the "
               "units of ", root_->name(), "; expected a call after backward() returns");
  if (reductions_.empty()) return;
  try {
    if (comm_ && comm_->streams()) comm_->streams()->on_mark("gradients wanted");
    reductions_.complete_all();
    if (comm_) {
      comm_->release_reduce_scatter_inputs("gradients wanted");
      comm_->finish_offload_copies();
    }
  } catch (const CollectiveError&) {
    mark_unusable("wait_for_gradients", std::current_exception());
    throw;
  }
}

void RootContext::check_usable() const {
  if (unusable_reason_.empty()) return;
  throw UnusableError(unusable_reason_);
}

void RootContext::mark_unusable(const std::string& what, const std::exception_ptr& error) {
  if (!unusable_reason_.empty()) return;  // the first failure is the cause
  std::string cause = "an unknown exception";
  try {
    if (error) std::rethrow_exception(error);
  } catch (const std::exception& e) {
    cause = exception_message(e);
  } catch (...) {
  }
  unusable_reason_ = cat(
      "fully_shard: the units of ", root_->name(), " are unusable: a collective failed during ",
      what, ", so the ranks may be at different points of the step and the sharded parameters "
      "cannot be trusted. Rebuild the process group and the model (e.g. reload it from a "
      "checkpoint). The failure was: ", cause);
}

void RootContext::reset_units(bool drop_grads) noexcept {
  bool waited = true;
  for (auto& weak : units_) {
    if (auto unit = weak.lock()) waited = unit->reset_after_failure(drop_grads) && waited;
  }
  if (!forward_order_recorded_) {
    forward_order_.clear();
    post_forward_order_.clear();
  }
  if (!waited && unusable_reason_.empty()) {
    unusable_reason_ = cat("fully_shard: the units of ", root_->name(),
                           " are unusable: a gather in flight could not be completed after a "
                           "failure. Rebuild the process group and the model.");
  }
}

void RootContext::recover_from_forward_error(const std::exception_ptr& error) noexcept {
  try {
    if (error) std::rethrow_exception(error);
  } catch (const CollectiveError&) {
    mark_unusable("the forward of " + root_->name(), error);
  } catch (...) {
  }
  if (pipeline_step_) {
    cancel_pipeline_step();
    return;
  }
  if (comm_ && comm_->streams()) comm_->streams()->on_mark("failure");
  reset_units(/*drop_grads=*/false);
  release_stream_buffers();
}

void RootContext::abandon_backward() noexcept {
  backward_in_flight_ = false;
  next_wave_ = 0;
  if (comm_ && comm_->streams()) comm_->streams()->on_mark("failure");
  // Every reduction issued so far was issued by every rank that got this
  // far: wait for it (its buffers are in use), then drop what it carried.
  if (!reductions_.abandon_all() && unusable_reason_.empty()) {
    unusable_reason_ = cat("fully_shard: the units of ", root_->name(),
                           " are unusable: a gradient reduction in flight failed when the "
                           "backward raised. Rebuild the process group and the model.");
  }
  reset_units(/*drop_grads=*/true);
  release_stream_buffers();
}

void RootContext::release_stream_buffers() noexcept {
  if (!comm_) return;
  try {
    comm_->release_all_gather_output();
    comm_->release_reduce_scatter_inputs("failure");
  } catch (...) {
  }
}

}  // namespace hp::fsdp
