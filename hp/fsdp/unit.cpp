#include "hp/fsdp/unit.h"

#include <torch/torch.h>

#include <algorithm>

#include "hp/distributed/world.h"
#include "hp/fsdp/registry.h"
#include "hp/fsdp/storage.h"
#include "hp/nn/activation_checkpoint.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/gpu_trace.h"
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

// The mode a unit runs in, for messages.
const char* mode_of(const MeshInfo& mesh) {
  if (!mesh.has_replicas()) return "FSDP";
  return mesh.shard_size > 1 ? "HSDP" : "DDP";
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

Unit::Unit(std::vector<std::shared_ptr<nn::Module>> modules, MeshInfo mesh,
           std::vector<std::unique_ptr<FSDPParam>> params, UnitFlags flags,
           MixedPrecisionPolicy mp, ParamGroup::Options group_options,
           dist::GroupPtr regather_group)
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
          mesh_, group_options),
      regather_group_(std::move(regather_group)) {
  // Main grads are filled by the reduction's last stage, so a unit that
  // keeps them takes that path even when there is nothing to communicate.
  communicates_ = mesh_.shard_size > 1 || mesh_.replicate_size > 1 || !group_.empty() ||
                  mp_.apply_grad_on_fp32_main_grad;
}

Unit::~Unit() {
  for (auto& handle : hook_handles_) handle.remove();
}

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

dist::GroupPtr Unit::regather_group_for(const MeshInfo& mesh, int64_t ranks) {
  if (ranks <= 1 || ranks >= mesh.shard_size) return nullptr;
  // Contiguous blocks of `ranks` shard ranks; each rank keeps piece
  // (shard_rank % ranks) of the gathered parameters after forward.
  const auto& shard_ranks = mesh.shard_group->ranks();
  const int64_t first = mesh.shard_rank / ranks * ranks;
  std::vector<int> block(shard_ranks.begin() + first, shard_ranks.begin() + first + ranks);
  return dist::new_group(block, {"fsdp-regather"});
}

void Unit::check_can_change_reshard_after_forward() const {
  const bool holds_pieces = std::any_of(params_.begin(), params_.end(), [](const auto& p) {
    return p->regather_piece().defined();
  });
  HP_CHECK_ARG(!holds_pieces && !group_.in_flight(),
               "set_reshard_after_forward: unit ", name_, " is between its forward and backward",
               holds_pieces ? " and holds pieces for a regather within groups of " : "",
               holds_pieces ? std::to_string(flags_.reshard_after_forward_ranks) : "",
               holds_pieces ? " ranks" : "",
               "; change the setting before forward or after backward (or call reshard() "
               "first)");
}

int64_t Unit::ranks_after_forward() const {
  if (flags_.reshard_after_forward) return flags_.reshard_after_forward_ranks;
  return is_root() ? 1 : mesh_.shard_size;
}

void Unit::set_reshard_after_forward(ReshardAfterForward setting, int64_t ranks,
                                     dist::GroupPtr regather_group) {
  if (setting) check_reshard_after_forward(ranks, mesh_.shard_size, name_);
  check_can_change_reshard_after_forward();
  flags_.reshard_after_forward = std::move(setting);
  flags_.reshard_after_forward_ranks = ranks;
  regather_group_ = std::move(regather_group);
}

void Unit::set_is_last_backward(bool value) {
  if (context_) {
    context_->set_is_last_backward(value);
  } else {
    is_last_backward_before_root_ = value;
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
        [weak](nn::Module& m, const nn::TensorList& inputs) -> std::optional<nn::TensorList> {
          auto unit = weak.lock();
          return unit ? unit->pre_forward(m, inputs) : std::nullopt;
        }));
    hook_handles_.push_back(module->register_forward_hook(
        [weak](nn::Module& m, const nn::TensorList&,
               const nn::TensorList& outputs) -> std::optional<nn::TensorList> {
          auto unit = weak.lock();
          return unit ? unit->post_forward(m, outputs) : std::nullopt;
        }));
    hook_handles_.push_back(module->register_forward_error_hook(
        [weak](nn::Module& m, const std::exception_ptr& error) {
          if (auto unit = weak.lock()) unit->on_forward_error(m, error);
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

std::vector<std::pair<at::Tensor, at::Tensor>> Unit::materialize() {
  std::vector<std::pair<at::Tensor, at::Tensor>> replaced;
  auto new_param_for = [&](FSDPParam& p) -> at::Tensor {
    if (is_dtensor(p.param())) return at::Tensor();  // re-pointed in place
    at::Tensor fresh = at::empty({0}, p.param().options().device(p.shard_device()));
    if (p.param().requires_grad()) fresh.set_requires_grad(true);
    replaced.emplace_back(p.param(), fresh);
    register_param(fresh, shared_from_this(), &p);
    return fresh;
  };
  group_.materialize(new_param_for);
  for (auto& p : params_) {
    if (p->on_meta()) p->materialize(at::Tensor(), new_param_for(*p));
  }
  return replaced;
}

void Unit::validate_for_training() const {
  // Deferred initialisation left undone: name what is uninitialised and the
  // call that initialises it (docs/features.md, F17).
  std::vector<std::string> on_meta;
  for (const auto& p : params_) {
    if (p->on_meta() || p->param().device().is_meta()) on_meta.push_back(p->fqn());
  }
  for (const auto& module : modules()) {
    for (const auto& item : module->named_buffers(/*recurse=*/true)) {
      if (item.value().is_meta()) on_meta.push_back(cat(item.key(), " (buffer)"));
    }
  }
  HP_CHECK_ARG(on_meta.empty(), mode_of(mesh_),
               " parameters should be materialized from meta device before training, but "
               "the following were still on meta device: ",
               to_string(on_meta),
               "\nFor example, initialize the module weights on a real device before running "
               "training.\nThey are uninitialised: after fully_shard over a meta model, call "
               "hp::init_sharded(model, plan) (e.g. plan = model->init_plan(); "
               "hp/fsdp/materialize.h) or hp::checkpoint::load_into_shards(model, path) "
               "(hp/checkpoint/load_into_shards.h) before the first forward.");
  for (const auto& p : params_) {
    HP_CHECK_ARG(p->param().device() == p->padded_shard().device(), "An ", mode_of(mesh_),
                 "-managed module unexpectedly has parameters on ", p->param().device(),
                 " (parameter '", p->fqn(), "'). Make sure to move the module to ",
                 mesh_.mesh->device_type(), " before training.");
  }
}

void Unit::complete_own_reductions() {
  if (!context_ || context_->reductions().empty()) return;
  for (auto& p : params_) {
    if (context_->reductions().pending_for(*p)) {
      // A reduction may still receive into this unit's unsharded buffers.
      context_->reductions().complete_all();
      return;
    }
  }
}

std::shared_ptr<trace::GpuMark> Unit::compute_mark() const {
  // The design's compute stream where the streams order the work; else,
  // for parameters on a GPU, the device's current stream (what the caller
  // computes on). Null on the host: there the host spans are the times.
  if (CommContext* comm = context_ ? context_->comm() : nullptr; comm && comm->streams()) {
    return comm->streams()->trace_mark(dist::StreamRole::kCompute);
  }
  if (!params_.empty() && params_[0]->compute_device().is_cuda()) {
    return cuda_trace_mark(params_[0]->compute_device());
  }
  return nullptr;
}

void Unit::trace_compute_start() {
  if (!trace::enabled()) {
    compute_start_us_ = 0;
    gpu_compute_start_ = nullptr;  // none kept from a start traced earlier
    return;
  }
  compute_start_us_ = trace::now_us();
  gpu_compute_start_ = compute_mark();
}

void Unit::trace_compute_end(const char* what) {
  std::string name = what + name_;
  trace::record(name, "compute", "compute", compute_start_us_, trace::now_us());
  // A start taken before tracing began has no mark: the host span alone.
  if (gpu_compute_start_) {
    trace::record_gpu(std::move(name), "compute", "compute", std::move(gpu_compute_start_),
                      compute_mark());
  }
}

void Unit::begin_unshard(bool snapshot) {
  if (context_) context_->check_usable();
  if (group_.empty()) return;
  complete_own_reductions();
  const bool stale =
      group_.begin_unshard(regather_group_.get(), snapshot, context_ ? context_->comm() : nullptr);
  if (stale && !stale_copy_traced_ && trace::enabled()) {
    // The copy kept after backward (reshard_after_backward = false) was
    // gathered before the shards changed (an optimizer step, a load): it is
    // gathered again. Worth knowing once: the copy's memory bought nothing.
    const int64_t now = trace::now_us();
    trace::record("stale kept copy of " + name_ + ": gathered again", "fsdp", "compute", now,
                  now);
    stale_copy_traced_ = true;
  }
}

void Unit::wait_unshard(bool keep_output) {
  if (context_) context_->check_usable();
  group_.finish_unshard(keep_output);
}

void Unit::reshard(bool keep_copies) {
  complete_own_reductions();
  group_.reshard(keep_copies);
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
  if (!flags_.implicit_prefetch || !context_->forward_order_recorded()) return;
  Unit* next = offset > 0 ? context_->next_in_forward(this) : context_->next_in_backward(this);
  if (next) start(next);
}

std::optional<nn::TensorList> Unit::pre_forward(nn::Module& module, const nn::TensorList& inputs) {
  context_or_become_root()->check_usable();
  if (state_ == State::kForward) return std::nullopt;  // a later module of a list unit
  if (state_ == State::kPipeline) {
    // Gathered since the pipeline step began: nothing to gather or prefetch.
    if (is_root()) context_->begin_forward();
    context_->note_pre_forward(this);
  } else {
    try {
      // A new iteration: reductions left by set_is_last_backward(false) land now.
      if (is_root()) {
        context_->begin_iteration(compute_device());
        context_->begin_forward();
      }
      context_->note_pre_forward(this);
      context_->record_forward(this);
      trace::Span span("unshard ", name_, "fsdp", "compute");
      begin_unshard();
      prefetch(forward_prefetch_, +1);
      wait_unshard(/*keep_output=*/true);
    } catch (const CollectiveError&) {
      context_->mark_unusable("the forward of unit " + name_, std::current_exception());
      throw;
    } catch (...) {
      // Nothing of this call is kept: the error hook will not see it as running.
      reset_after_failure(/*drop_grads=*/false);
      throw;
    }
  }
  modules_to_run_.clear();
  for (const auto& weak : modules_) {
    if (auto m = weak.lock()) modules_to_run_.push_back(m.get());
  }
  state_ = State::kForward;
  trace_compute_start();
  if (mp_.param_dtype && mp_.cast_forward_inputs) return cast_floating(inputs, *mp_.param_dtype);
  return std::nullopt;
}

std::optional<nn::TensorList> Unit::post_forward(nn::Module& module,
                                                 const nn::TensorList& outputs) {
  if (state_ != State::kForward) return std::nullopt;
  modules_to_run_.erase(std::remove(modules_to_run_.begin(), modules_to_run_.end(), &module),
                        modules_to_run_.end());
  if (!modules_to_run_.empty()) return std::nullopt;
  // Still kForward until the state changes below: should anything here
  // raise, the error hook resets the unit (the tree, for the root).
  if (is_root()) context_->check_hooks_ran(outputs);
  if (trace::enabled()) trace_compute_end("forward ");
  // The stream log's marker of this unit's forward kernels (docs/streams.md).
  if (CommContext* comm = context_->comm(); comm && comm->streams()) {
    comm->streams()->on_mark("compute forward");
  }
  std::optional<nn::TensorList> replaced;
  if (mp_.output_dtype) replaced = cast_floating(outputs, *mp_.output_dtype);
  const nn::TensorList& result = replaced ? *replaced : outputs;
  const bool backward_follows =
      at::GradMode::is_enabled() &&
      std::any_of(result.begin(), result.end(),
                  [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  context_->record_post_forward(this);
  if (is_root()) {
    context_->finish_recording();
    // The last unit's all-gather output has no next unshard to release it.
    if (context_->comm()) context_->comm()->release_all_gather_output();
  }
  if (context_->in_pipeline_step()) {
    // The parameters stay gathered, and no pre-backward is needed: the
    // step's backwards only accumulate (finish_pipeline_step reduces).
    state_ = State::kPipeline;
    return replaced;
  }
  if (!communicates_) {
    state_ = State::kIdle;
    return replaced;
  }
  const int64_t keep_over = ranks_after_forward();
  if (!backward_follows) {
    // Only an explicit false keeps them: the default keeps the root's for
    // the backward that follows at once, and none follows here.
    const bool keep = flags_.reshard_after_forward && keep_over == 1;
    if (!keep) reshard();
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
  // A unit that runs inside a checkpointed module's recomputation keeps its
  // parameters: its backward follows at once, so one gather serves both.
  if (keep_over == 1 || nn::in_recomputation()) return replaced;
  if (regather_group_) {
    group_.keep_for_regather(keep_over, mesh_.shard_rank % keep_over);
  } else {
    group_.free_unsharded();
  }
  return replaced;
}

void Unit::on_forward_error(nn::Module& module, const std::exception_ptr& error) {
  // Only a forward whose pre-forward completed is running (pre_forward
  // undoes itself when it raises).
  if (state_ != State::kForward) return;
  if (context_->in_pipeline_step() && !is_root()) {
    // Still gathered for the step; the root's error hook, which the error
    // reaches next, ends the step for the whole tree.
    state_ = State::kPipeline;
    return;
  }
  if (is_root()) {
    context_->recover_from_forward_error(error);
  } else if (!reset_after_failure(/*drop_grads=*/false)) {
    context_->mark_unusable("the forward of unit " + name_, error);
  }
}

template <typename Fn>
void Unit::in_backward(const char* what, Fn&& step) {
  try {
    step();
  } catch (const CollectiveError&) {
    context_->mark_unusable(std::string(what) + " of unit " + name_, std::current_exception());
    throw;
  }
}

void Unit::pre_backward() {
  // In a pipeline step the parameters are gathered and every backward only
  // accumulates (a forward from before the step may still have hooked it).
  if (state_ == State::kPreBackward || state_ == State::kPipeline) return;
  context_->check_usable();
  context_->ensure_end_of_backward();
  in_backward("the backward", [&] {
    trace::Span span("unshard ", name_, "fsdp", "compute");
    begin_unshard();
    prefetch(backward_prefetch_, -1);
    wait_unshard();
  });
  // A unit that communicates reduces only this backward's gradients, so
  // earlier ones wait aside; otherwise autograd accumulates in place.
  if (communicates_) {
    for (auto& p : params_) p->stash_grad();
  }
  trace_compute_start();
  state_ = State::kPreBackward;
  grads_.begin(params_, group_.fused() && flags_.requires_gradient_sync,
               /*pack_whole=*/!keeps_whole_grads_unreduced());
}

bool Unit::keeps_whole_grads_unreduced() const {
  return group_.fused() && mesh_.has_replicas() && !flags_.requires_all_reduce;
}

void Unit::post_accumulate(FSDPParam& param) {
  if (state_ == State::kPipeline) {
    // A pipeline step's backwards accumulate the whole gradient over its
    // micro-batches; finish_pipeline_step reduces it once. Autograd adds
    // them in .grad when that is the reduce dtype. Otherwise each one's is
    // cast and added to the kept gradient in the reduce dtype, as a no-sync
    // backward keeps it (and FSDP2 outside gradient sync): with bf16
    // parameters and fp32 reduction the M micro-batches then add up in
    // fp32, not in bf16.
    const at::Tensor& grad = param.param().grad();
    if (grad.defined() && grad.scalar_type() != param.reduce_dtype())
      param.keep_for_later(param.take_grad());
    return;
  }
  in_backward("the gradient reduction", [&] {
    if (grads_.wave() < 0) {
      grads_.set_wave(context_->take_wave());
      // Without fusion, memory first: the previous unit's reductions land now.
      if (!group_.fused()) context_->reductions().complete_before(grads_.wave());
    }
    const bool last = grads_.arrive();
    if (last && trace::enabled()) trace_compute_end("backward ");
    if (CommContext* comm = context_->comm(); last && comm && comm->streams()) {
      comm->streams()->on_mark("compute backward");
    }
    at::Tensor grad = param.take_grad();
    if (!flags_.requires_gradient_sync) {
      // No-sync micro-batch: keep the full gradient, reduce it with the next
      // synchronised one (exactly equal to one large batch).
      param.keep_for_later(std::move(grad));
      param.restore_stash();
      if (!group_.fused()) reshard_after_backward(param);
      if (group_.fused() && last) reshard_after_backward();
      return;
    }
    if (!group_.fused()) {
      // The optimizer steps the shard, so a reduced gradient always goes
      // with a resharded parameter; its unsharded buffer receives the
      // reduce-scatter, unless it is kept for the next forward.
      at::Tensor scratch;
      if (flags_.reshard_after_backward) {
        scratch = param.reshard_lending_buffer();
      } else {
        param.reshard_keeping_unsharded();
      }
      context_->reductions().push(std::make_unique<GradReduction>(
          PackedGrads::of(param, std::move(grad)), std::move(scratch), mesh_,
          ReduceSettings{flags_.average, flags_.requires_all_reduce}, grads_.wave(),
          shared_from_this(), context_->comm()));
      return;
    }
    if (!param.sharded() && keeps_whole_grads_unreduced()) {
      // Its reduction reaches every rank of the mesh, replicas included, so
      // it waits as a no-sync gradient does for a backward with all-reduce.
      param.keep_for_later(std::move(grad));
      param.restore_stash();
    } else {
      // Fused: pack it now (its full tensor goes at once), reduce with the
      // last; on the streams all are packed with the last, by one kernel.
      const CommContext* comm = context_->comm();
      const bool on_streams = comm != nullptr && comm->streams() != nullptr;
      grads_.pack(param, std::move(grad), /*defer=*/root_of_others() || on_streams);
    }
    if (last) reduce_fused();
  });
}

void Unit::reduce_fused() {
  // The pipeline: older reductions move on one stage (reduce-scatter done ->
  // all-reduce issued; all-reduce done -> gradients assigned).
  context_->reductions().advance_before(grads_.wave());
  at::Tensor scratch;
  if (flags_.reshard_after_backward) {
    scratch = group_.reshard_lending_flat_buffer();
  } else {
    group_.reshard_keeping_unsharded();
  }
  grads_.flush(context_->reductions(), std::move(scratch), mesh_,
               ReduceSettings{flags_.average, flags_.requires_all_reduce}, shared_from_this(),
               context_->comm());
}

void Unit::reshard_after_backward(FSDPParam& param) {
  if (flags_.reshard_after_backward) {
    param.reshard();
  } else {
    param.reshard_keeping_unsharded();
  }
}

void Unit::reshard_after_backward() {
  if (flags_.reshard_after_backward) {
    group_.reshard();
  } else {
    group_.reshard_keeping_unsharded();
  }
}

void Unit::finish_backward() {
  // Some parameters got no gradient: reduce what did arrive.
  if (group_.fused() && flags_.requires_gradient_sync && grads_.partly_arrived()) reduce_fused();
  grads_.reset();
  group_.finish_unshard();
  if (flags_.reshard_after_backward) {
    for (auto& p : params_) {
      if (!context_->reductions().pending_for(*p)) p->reshard();
    }
    group_.free_unsharded();
  } else {
    // Every parameter holds its shard (the optimizer may step); the gathered
    // copies stay for the next forward. No reduction received into them.
    group_.reshard_keeping_unsharded();
  }
  for (auto& p : params_) {
    if (!context_->reductions().pending_for(*p)) p->restore_stash();
  }
  state_ = State::kIdle;
}

void Unit::enter_pipeline_step() {
  // Earlier gradients (shard-shaped) wait aside, so autograd accumulates
  // this step's whole ones fresh; finish_backward adds them back.
  for (auto& p : params_) {
    p->stash_grad();
    p->remember_kept_grad();
  }
  state_ = State::kPipeline;
}

void Unit::reduce_pipeline_grads() {
  state_ = State::kPreBackward;
  if (!communicates_) return;  // autograd accumulated in place: nothing to reduce
  trace_compute_start();  // the trace's "backward" span of this unit: its gradients' packing
  grads_.begin(params_, group_.fused() && flags_.requires_gradient_sync,
               /*pack_whole=*/!keeps_whole_grads_unreduced());
  for (auto& p : params_) {
    p->forget_remembered_kept_grad();
    if (p->requires_grad() && (p->param().grad().defined() || p->has_kept_grad()))
      post_accumulate(*p);
  }
}

const std::shared_ptr<RootContext>& Unit::context_or_become_root() {
  if (!context_) context_ = RootContext::create(*this);
  return context_;
}

c10::Device Unit::compute_device() const {
  return params_.empty() ? c10::Device(c10::kCPU) : params_[0]->compute_device();
}

bool Unit::reset_after_failure(bool drop_grads) noexcept {
  bool waited = true;
  try {
    group_.finish_unshard();
  } catch (...) {
    // The gather failed (it timed out or a peer is gone): nothing of it is
    // used, and the tree is unusable anyway.
    waited = false;
    group_.forget_in_flight();
  }
  try {
    group_.reshard();
    for (auto& p : params_) {
      if (drop_grads) p->zero_grad();
    }
  } catch (...) {
    waited = false;
  }
  grads_.reset();
  modules_to_run_.clear();
  state_ = State::kIdle;
  return waited;
}

}  // namespace hp::fsdp
