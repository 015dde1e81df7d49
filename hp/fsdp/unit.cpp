#include "hp/fsdp/unit.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>

#include "hp/util/error.h"

namespace hp::fsdp {

void RootContext::finish_backward() {
  for (auto& weak : units) {
    if (auto unit = weak.lock()) unit->finish_backward();
  }
  if (root->flags().is_last_backward) reductions.complete_all();
  callback_queued = false;
  next_wave = 0;
}

Unit::Unit(std::vector<std::shared_ptr<nn::Module>> modules, MeshInfo mesh,
           std::vector<std::unique_ptr<FSDPParam>> params, UnitFlags flags)
    : modules_(std::move(modules)),
      mesh_(std::move(mesh)),
      params_(std::move(params)),
      flags_(flags) {}

Unit::~Unit() {
  for (auto& handle : hook_handles_) handle.remove();
}

std::string Unit::name() const { return modules_.empty() ? "?" : modules_[0]->name(); }

void Unit::install_hooks() {
  std::weak_ptr<Unit> weak = weak_from_this();
  for (auto& module : modules_) {
    hook_handles_.push_back(module->register_forward_pre_hook(
        [weak](nn::Module&, const nn::TensorList& inputs) -> std::optional<nn::TensorList> {
          auto unit = weak.lock();
          return unit ? unit->pre_forward(inputs) : std::nullopt;
        }));
    hook_handles_.push_back(module->register_forward_hook(
        [weak](nn::Module&, const nn::TensorList&,
               const nn::TensorList& outputs) -> std::optional<nn::TensorList> {
          auto unit = weak.lock();
          return unit ? unit->post_forward(outputs) : std::nullopt;
        }));
  }
  for (auto& param : params_) {
    FSDPParam* raw = param.get();
    param->set_post_accumulate_hook([weak, raw] {
      if (auto unit = weak.lock()) unit->post_accumulate(*raw);
    });
  }
}

void Unit::become_root() {
  auto context = std::make_shared<RootContext>();
  context->root = this;
  context->units.push_back(weak_from_this());
  context_ = context;
  for (auto& module : modules_) {
    for (auto& sub : module->modules(/*include_self=*/false)) {
      auto hookable = std::dynamic_pointer_cast<nn::Module>(sub);
      if (!hookable) continue;
      auto unit = hookable->attachment<Unit>(kUnitAttachment);
      if (!unit || unit.get() == this || unit->context_ == context) continue;
      HP_CHECK_ARG(unit->state_ == State::kIdle, "fully_shard: unit ", unit->name(),
                   " is in the middle of a forward/backward pass of another root; run the "
                   "outermost module's forward instead");
      unit->context_ = context;
      context->units.push_back(unit);
    }
  }
  for (auto& weak : context->units) {
    if (auto unit = weak.lock()) unit->validate_for_training();
  }
}

void Unit::validate_for_training() const {
  std::vector<std::string> on_meta;
  for (const auto& p : params_) {
    if (p->param().device().is_meta()) on_meta.push_back(p->fqn());
  }
  HP_CHECK_ARG(on_meta.empty(),
               "HSDP parameters should be materialized from meta device before training, but "
               "the following were still on meta device: ",
               to_string(on_meta),
               "\nFor example, initialize the module weights on a real device before running "
               "training.");
  for (const auto& p : params_) {
    HP_CHECK_ARG(p->param().device().type() == at::kCPU,
                 "An FSDP-managed module unexpectedly has parameters on ", p->param().device(),
                 " (parameter '", p->fqn(), "'). Make sure to move the module to ",
                 mesh_.mesh->device_type(), " before training.");
  }
}

void Unit::begin_unshard() {
  if (unshard_in_flight_) return;
  // A pending reduction may still be receiving into a parameter's unsharded
  // buffer (set_is_last_backward(false)); it lands before that buffer is
  // gathered into again.
  if (context_) {
    for (auto& p : params_) {
      if (context_->reductions.pending_for(*p)) {
        context_->reductions.complete_all();
        break;
      }
    }
  }
  for (auto& p : params_) {
    if (p->sharded() && p->data() != FSDPParam::Data::kUnsharded) {
      unshard_works_.push_back(p->all_gather(*mesh_.shard_group));
    }
  }
  unshard_in_flight_ = true;
}

void Unit::wait_unshard() {
  if (!unshard_in_flight_) return;
  for (auto& work : unshard_works_) work.wait();
  unshard_works_.clear();
  for (auto& p : params_) {
    if (p->sharded() && p->data() != FSDPParam::Data::kUnsharded) p->use_unsharded();
  }
  unshard_in_flight_ = false;
}

void Unit::reshard() {
  wait_unshard();
  for (auto& p : params_) p->reshard();
}

void Unit::zero_grad() {
  for (auto& p : params_) p->zero_grad();
}

std::optional<nn::TensorList> Unit::pre_forward(const nn::TensorList& inputs) {
  if (!context_) become_root();
  if (forward_depth_++ > 0) return std::nullopt;
  // A new iteration: reductions left by set_is_last_backward(false) land now.
  if (is_root()) context_->reductions.complete_all();
  if (!context_->forward_order_recorded) {
    auto& order = context_->forward_order;
    if (std::find(order.begin(), order.end(), this) == order.end()) order.push_back(this);
  }
  begin_unshard();
  wait_unshard();
  state_ = State::kForward;
  return std::nullopt;
}

std::optional<nn::TensorList> Unit::post_forward(const nn::TensorList& outputs) {
  if (--forward_depth_ > 0) return std::nullopt;
  const bool backward_follows =
      at::GradMode::is_enabled() &&
      std::any_of(outputs.begin(), outputs.end(),
                  [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (is_root()) context_->forward_order_recorded = true;
  if (!backward_follows) {
    if (flags_.reshard_after_forward) reshard();
    state_ = State::kIdle;
    return std::nullopt;
  }
  std::weak_ptr<Unit> weak = weak_from_this();
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([weak](const at::Tensor&) {
      if (auto unit = weak.lock()) unit->pre_backward();
    });
  }
  state_ = State::kAfterForward;
  // The root's parameters would be gathered again right away for backward.
  const bool root_of_others = is_root() && context_->units.size() > 1;
  if (flags_.reshard_after_forward && !root_of_others) {
    for (auto& p : params_) p->free_unsharded();
  }
  return std::nullopt;
}

void Unit::pre_backward() {
  if (state_ == State::kPreBackward) return;
  if (!context_->callback_queued) {
    context_->callback_queued = true;
    std::shared_ptr<RootContext> context = context_;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [context] { context->finish_backward(); });
  }
  begin_unshard();
  wait_unshard();
  for (auto& p : params_) p->stash_grad();
  state_ = State::kPreBackward;
  wave_ = -1;
}

void Unit::post_accumulate(FSDPParam& param) {
  if (wave_ < 0) {
    wave_ = context_->next_wave++;
    context_->reductions.complete_before(wave_);
  }
  at::Tensor grad = param.take_grad();
  if (!flags_.requires_gradient_sync) {
    // No-sync micro-batch: keep the full gradient, reduce it with the next
    // synchronised one (exactly equal to one large batch).
    param.keep_for_later(std::move(grad));
    if (flags_.reshard_after_backward) param.reshard();
    param.restore_stash();
    return;
  }
  // The optimizer steps the shard, so a reduced gradient always goes with
  // a resharded parameter; its unsharded buffer receives the reduce-scatter.
  at::Tensor scratch = param.reshard_lending_buffer();
  context_->reductions.issue(param, std::move(grad), std::move(scratch), mesh_,
                             {flags_.average, flags_.requires_all_reduce}, wave_,
                             shared_from_this());
}

void Unit::finish_backward() {
  for (auto& p : params_) {
    if (flags_.reshard_after_backward || flags_.requires_gradient_sync) p->reshard();
    if (!context_->reductions.pending_for(*p)) p->restore_stash();
  }
  state_ = State::kIdle;
  wave_ = -1;
}

}  // namespace hp::fsdp
