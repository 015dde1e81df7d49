#include "hp/fsdp/unit.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>

#include "hp/dist/world.h"
#include "hp/fsdp/storage.h"
#include "hp/util/error.h"
#include "hp/util/trace.h"

namespace hp::fsdp {
namespace {

// Floating-point tensors of `tensors` cast to `dtype` (others unchanged).
nn::TensorList cast_floating(const nn::TensorList& tensors, at::ScalarType dtype) {
  nn::TensorList out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    const bool cast = t.defined() && at::isFloatingType(t.scalar_type()) && t.scalar_type() != dtype;
    out.push_back(cast ? t.to(dtype) : t);
  }
  return out;
}

}  // namespace

std::vector<std::shared_ptr<Unit>> units_in_tree(const nn::Module& module, bool include_self) {
  // modules() is not const in libtorch, though it changes nothing.
  auto& walked = const_cast<nn::Module&>(module);
  std::vector<std::shared_ptr<Unit>> out;
  for (const auto& sub : walked.modules(include_self)) {
    auto hookable = std::dynamic_pointer_cast<nn::Module>(sub);
    if (!hookable) continue;
    auto unit = hookable->attachment<Unit>(kUnitAttachment);
    if (unit && std::find(out.begin(), out.end(), unit) == out.end()) out.push_back(unit);
  }
  return out;
}

void RootContext::finish_backward() {
  for (auto& weak : units) {
    if (auto unit = weak.lock()) unit->finish_backward();
  }
  if (root->flags().is_last_backward) reductions.complete_all();
  callback_queued = false;
  next_wave = 0;
}

Unit* RootContext::neighbour(const Unit* unit, int offset) const {
  auto it = std::find(forward_order.begin(), forward_order.end(), unit);
  if (it == forward_order.end()) return nullptr;
  const auto index = (it - forward_order.begin()) + offset;
  if (index < 0 || index >= static_cast<int64_t>(forward_order.size())) return nullptr;
  return forward_order[index];
}

Unit::Unit(std::vector<std::shared_ptr<nn::Module>> modules, MeshInfo mesh,
           std::vector<std::unique_ptr<FSDPParam>> params, UnitFlags flags,
           MixedPrecisionPolicy mp, ParamGroup::Options group_options)
    : modules_(modules.begin(), modules.end()),
      name_(modules.empty() ? "?" : modules[0]->name()),
      mesh_(std::move(mesh)),
      params_(std::move(params)),
      flags_(flags),
      mp_(mp),
      group_(
          [this] {
            std::vector<FSDPParam*> needing;
            for (auto& p : params_) {
              if (p->needs_unshard()) needing.push_back(p.get());
            }
            return needing;
          }(),
          mesh_, group_options) {
  set_reshard_after_forward(flags_.reshard_after_forward_ranks);
  // Main grads are filled by the reduction's last stage, so a unit that
  // keeps them takes that path even when there is nothing to communicate.
  communicates_ = mesh_.shard_size > 1 || mesh_.replicate_size > 1 || !group_.empty() ||
                  mp_.apply_grad_on_fp32_main_grad;
}

Unit::~Unit() {
  for (auto& handle : hook_handles_) handle.remove();
}

std::string Unit::name() const { return name_; }

std::vector<std::shared_ptr<nn::Module>> Unit::modules() const {
  std::vector<std::shared_ptr<nn::Module>> alive;
  for (const auto& weak : modules_) {
    if (auto module = weak.lock()) alive.push_back(std::move(module));
  }
  return alive;
}

void Unit::check_reshard_after_forward(int64_t ranks, int64_t shard_size,
                                       const std::string& unit_name) {
  HP_CHECK_ARG(ranks >= 1 && ranks <= shard_size && shard_size % ranks == 0,
               "reshard_after_forward as an int must be a divisor of the shard group size ",
               shard_size, " of unit ", unit_name, " (1 keeps the parameters gathered, ",
               shard_size, " reshards them fully), got ", ranks);
}

void Unit::set_reshard_after_forward(int64_t ranks) {
  const int64_t shard_size = mesh_.shard_size;
  check_reshard_after_forward(ranks, shard_size, name_);
  flags_.reshard_after_forward_ranks = ranks;
  regather_group_ = nullptr;
  if (ranks > 1 && ranks < shard_size) {
    // Contiguous blocks of `ranks` shard ranks; each rank keeps piece
    // (shard_rank % ranks) of the gathered parameters after forward.
    const auto& shard_ranks = mesh_.shard_group->ranks();
    const int64_t first = mesh_.shard_rank / ranks * ranks;
    std::vector<int> block(shard_ranks.begin() + first, shard_ranks.begin() + first + ranks);
    regather_group_ = dist::new_group(block, {"fsdp-regather"});
  }
}

void Unit::set_forward_prefetch(std::vector<std::weak_ptr<Unit>> units) {
  forward_prefetch_ = std::move(units);
}

void Unit::set_backward_prefetch(std::vector<std::weak_ptr<Unit>> units) {
  backward_prefetch_ = std::move(units);
}

void Unit::install_hooks() {
  std::weak_ptr<Unit> weak = weak_from_this();
  for (auto& module : modules()) {
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
  if (!communicates_) return;  // autograd's accumulation is all there is to do
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
  for (auto& module : modules()) {
    for (auto& unit : units_in_tree(*module, /*include_self=*/false)) {
      if (unit.get() == this || unit->context_ == context) continue;
      HP_CHECK_ARG(unit->state_ == State::kIdle, "fully_shard: unit ", unit->name(),
                   " is in the middle of a forward/backward pass of another root; run the "
                   "outermost module's forward instead");
      unit->context_ = context;
      context->units.push_back(unit);
      // set_is_last_backward(false) on this unit before its root existed.
      flags_.is_last_backward = flags_.is_last_backward && unit->flags_.is_last_backward;
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

void Unit::complete_own_reductions() {
  if (!context_ || context_->reductions.empty()) return;
  for (auto& p : params_) {
    if (context_->reductions.pending_for(*p)) {
      // A reduction may still receive into this unit's unsharded buffers.
      context_->reductions.complete_all();
      return;
    }
  }
}

void Unit::begin_unshard() {
  if (group_.empty()) return;
  complete_own_reductions();
  group_.begin_unshard(regather_group_.get());
}

void Unit::wait_unshard() { group_.finish_unshard(); }

void Unit::reshard() {
  complete_own_reductions();
  group_.reshard();
}

void Unit::zero_grad() {
  for (auto& p : params_) p->zero_grad();
}

void Unit::prefetch(const std::vector<std::weak_ptr<Unit>>& explicit_units, int offset) {
  // Forward prefetches units that have not run yet in this iteration;
  // backward, units whose forward ran and whose backward has not started.
  const State wanted = offset > 0 ? State::kIdle : State::kAfterForward;
  auto start = [&](Unit* unit) {
    if (unit != this && unit->state_ == wanted) unit->begin_unshard();
  };
  if (!explicit_units.empty()) {
    for (const auto& weak : explicit_units) {
      if (auto unit = weak.lock()) start(unit.get());
    }
    return;
  }
  if (!flags_.implicit_prefetch || !context_->forward_order_recorded) return;
  if (Unit* next = context_->neighbour(this, offset)) start(next);
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
  {
    const int64_t start = trace::enabled() ? trace::now_us() : 0;
    begin_unshard();
    prefetch(forward_prefetch_, +1);
    wait_unshard();
    if (trace::enabled()) trace::record("unshard " + name_, "fsdp", "compute", start, trace::now_us());
  }
  state_ = State::kForward;
  compute_start_us_ = trace::enabled() ? trace::now_us() : 0;
  if (mp_.param_dtype && mp_.cast_forward_inputs) return cast_floating(inputs, *mp_.param_dtype);
  return std::nullopt;
}

std::optional<nn::TensorList> Unit::post_forward(const nn::TensorList& outputs) {
  if (--forward_depth_ > 0) return std::nullopt;
  if (trace::enabled()) {
    trace::record("forward " + name_, "compute", "compute", compute_start_us_, trace::now_us());
  }
  std::optional<nn::TensorList> replaced;
  if (mp_.output_dtype) replaced = cast_floating(outputs, *mp_.output_dtype);
  const nn::TensorList& result = replaced ? *replaced : outputs;
  const bool backward_follows =
      at::GradMode::is_enabled() &&
      std::any_of(result.begin(), result.end(),
                  [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  if (is_root()) context_->forward_order_recorded = true;
  if (!communicates_) {
    state_ = State::kIdle;
    return replaced;
  }
  const int64_t keep_over = flags_.reshard_after_forward_ranks;
  if (!backward_follows) {
    if (keep_over != 1) reshard();
    state_ = State::kIdle;
    return replaced;
  }
  std::weak_ptr<Unit> weak = weak_from_this();
  for (const auto& out : result) {
    if (!out.defined() || !out.requires_grad()) continue;
    out.register_hook([weak](const at::Tensor&) {
      if (auto unit = weak.lock()) unit->pre_backward();
    });
  }
  state_ = State::kAfterForward;
  // The root's parameters would be gathered again right away for backward.
  if (root_of_others() || keep_over == 1) return replaced;
  if (regather_group_) {
    group_.keep_for_regather(keep_over, mesh_.shard_rank % keep_over);
  } else {
    group_.free_unsharded();
  }
  return replaced;
}

void Unit::pre_backward() {
  if (state_ == State::kPreBackward) return;
  if (!context_->callback_queued) {
    context_->callback_queued = true;
    std::shared_ptr<RootContext> context = context_;
    torch::autograd::Engine::get_default_engine().queue_callback(
        [context] { context->finish_backward(); });
  }
  {
    const int64_t start = trace::enabled() ? trace::now_us() : 0;
    begin_unshard();
    prefetch(backward_prefetch_, -1);
    wait_unshard();
    if (trace::enabled()) trace::record("unshard " + name_, "fsdp", "compute", start, trace::now_us());
  }
  // A unit that communicates reduces only this backward's gradients, so
  // earlier ones wait aside; otherwise autograd accumulates in place.
  if (communicates_) {
    for (auto& p : params_) p->stash_grad();
  }
  compute_start_us_ = trace::enabled() ? trace::now_us() : 0;
  state_ = State::kPreBackward;
  wave_ = -1;
  grads_arrived_ = 0;
  grads_expected_ = 0;
  for (auto& p : params_) grads_expected_ += p->requires_grad() ? 1 : 0;
  if (group_.fused() && flags_.requires_gradient_sync) start_packing();
}

void Unit::post_accumulate(FSDPParam& param) {
  if (wave_ < 0) {
    wave_ = context_->next_wave++;
    // Without fusion, memory first: the previous unit's reductions land now.
    if (!group_.fused()) context_->reductions.complete_before(wave_);
  }
  ++grads_arrived_;
  if (grads_arrived_ == grads_expected_ && trace::enabled()) {
    trace::record("backward " + name_, "compute", "compute", compute_start_us_, trace::now_us());
  }
  at::Tensor grad = param.take_grad();
  if (!flags_.requires_gradient_sync) {
    // No-sync micro-batch: keep the full gradient, reduce it with the next
    // synchronised one (exactly equal to one large batch).
    param.keep_for_later(std::move(grad));
    param.restore_stash();
    if (!group_.fused() && flags_.reshard_after_backward) param.reshard();
    if (group_.fused() && grads_arrived_ == grads_expected_ && flags_.reshard_after_backward) {
      group_.reshard();
    }
    return;
  }
  ReduceSettings settings{flags_.average, flags_.requires_all_reduce};
  if (!group_.fused()) {
    // The optimizer steps the shard, so a reduced gradient always goes with
    // a resharded parameter; its unsharded buffer receives the reduce-scatter.
    at::Tensor scratch = param.reshard_lending_buffer();
    context_->reductions.push(std::make_unique<GradReduction>(
        PackedGrads::of(param, std::move(grad)), std::move(scratch), mesh_, settings, wave_,
        shared_from_this()));
    return;
  }
  // Fused: pack it now (its full tensor goes at once), reduce with the last.
  if (root_of_others()) {
    unpacked_.emplace_back(&param, std::move(grad));
  } else {
    (param.sharded() ? packed_sharded_ : packed_whole_).add(param, grad);
    grad = at::Tensor();
  }
  if (grads_arrived_ == grads_expected_) reduce_fused();
}

void Unit::start_packing() {
  std::vector<FSDPParam*> sharded, whole;
  for (auto& p : params_) {
    if (p->requires_grad()) (p->sharded() ? sharded : whole).push_back(p.get());
  }
  packed_sharded_ = sharded.empty() ? PackedGrads() : PackedGrads(std::move(sharded));
  packed_whole_ = whole.empty() ? PackedGrads() : PackedGrads(std::move(whole));
}

void Unit::reduce_fused() {
  // The pipeline: older reductions move on one stage (reduce-scatter done ->
  // all-reduce issued; all-reduce done -> gradients assigned).
  context_->reductions.advance_before(wave_);
  for (auto& [param, grad] : unpacked_) {
    (param->sharded() ? packed_sharded_ : packed_whole_).add(*param, grad);
    grad = at::Tensor();
  }
  unpacked_.clear();
  at::Tensor scratch = group_.reshard_lending_flat_buffer();
  ReduceSettings settings{flags_.average, flags_.requires_all_reduce};
  if (!packed_sharded_.empty()) {
    context_->reductions.push(std::make_unique<GradReduction>(
        std::move(packed_sharded_), std::move(scratch), mesh_, settings, wave_,
        shared_from_this()));
  } else if (scratch.defined()) {
    // Nothing to reduce-scatter into it: the lent buffer is released here,
    // since the group leaves a lent buffer to its borrower.
    free_storage(scratch);
  }
  if (!packed_whole_.empty()) {
    context_->reductions.push(std::make_unique<GradReduction>(
        std::move(packed_whole_), at::Tensor(), mesh_, settings, wave_, shared_from_this()));
  }
  packed_sharded_ = PackedGrads();
  packed_whole_ = PackedGrads();
}

void Unit::finish_backward() {
  // Some parameters got no gradient: reduce what did arrive.
  if (group_.fused() && flags_.requires_gradient_sync && grads_arrived_ > 0 &&
      grads_arrived_ < grads_expected_) {
    reduce_fused();
  }
  grads_arrived_ = 0;
  if (flags_.reshard_after_backward || flags_.requires_gradient_sync) {
    group_.finish_unshard();
    for (auto& p : params_) {
      if (!context_->reductions.pending_for(*p)) p->reshard();
    }
    group_.free_unsharded();
  }
  for (auto& p : params_) {
    if (!context_->reductions.pending_for(*p)) p->restore_stash();
  }
  state_ = State::kIdle;
  wave_ = -1;
}

}  // namespace hp::fsdp
