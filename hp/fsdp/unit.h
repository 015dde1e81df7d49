// A fully_shard unit: the parameters of one module (or a list of modules)
// that are gathered, resharded and reduced together (F4, F9-F12, F15 in
// docs/features.md; the parameter lifecycle is in docs/design.md).
//
// The unit is a state machine driven by hooks:
//
//            pre-forward                 post-forward, a backward follows
//   kIdle ──────────────▶ kForward ────────────────────────────▶ kAfterForward
//     ▲                      │ post-forward, no backward (no grad)     │ first output
//     │◀─────────────────────┘ (reshards)                              │ gradient
//     │                                                                ▼ (pre-backward)
//     └──────────── end of backward (the root's callback) ─────── kPreBackward
//
//   pre-forward     (a list unit: its first module to run) gather the shards
//                   (or wait for a prefetch), point the parameters at them,
//                   prefetch the next unit, cast inputs
//   post-forward    (a list unit: after its last module) release the
//                   gathered memory (reshard_after_forward: true frees, N
//                   keeps pieces for a group of N ranks), hook the outputs'
//                   gradients, cast outputs
//   pre-backward    gather again into the same storage, prefetch the previous
//                   unit, stash gradients of earlier backwards, queue the end
//                   of backward
//   post-accumulate (per parameter) take the full gradient; without fusion
//                   reshard that parameter and queue its reduction, with
//                   fusion queue the unit's once all its gradients are in
//                   (one reduce-scatter of the sharded ones, one all-reduce
//                   over the mesh of those kept whole)
//   end of backward reduce what is left, reshard (or, with
//                   reshard_after_backward false, point the parameters at
//                   their shards and keep the gathered copies for the next
//                   gather while the shards do not change), complete the
//                   reductions, back to kIdle.
//
// A pipeline step (FSDPModule::begin_pipeline_step) holds every unit of the
// tree in kPipeline: gathered, with forwards (kForward while one runs) that
// gather and free nothing and register no pre-backward, and backwards whose
// accumulations autograd leaves whole in .grad; finish_pipeline_step feeds
// them through post-accumulate (kPreBackward) and ends them as one backward
// (kIdle).
//
// Failures: an exception that leaves a module's call after the unit's
// pre-forward (its forward, a hook, a later unit) reshards the unit and
// returns it to kIdle; when it leaves the root's call, every unit of the
// tree is reset (RootContext::recover_from_forward_error). A backward that
// raises resets the tree and drops its gradients (abandon_backward). A
// failed collective makes the tree unusable: see root_context.h.
//
// Threads: the forward hooks (pre-forward, post-forward, the error hook)
// run on the thread that calls the module; the backward hooks (pre-backward
// from the outputs' gradient hooks, post-accumulate from the parameters'
// accumulators) on the autograd engine's thread for the device: for CPU
// tensors the thread that called backward(), for CUDA the engine's device
// thread while backward() blocks. So one thread at a time runs a tree's
// hooks, and a unit needs no lock. Completions of its collectives run on
// the backend's thread and touch only the buffers they complete
// (param_group.h, reduction.h).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/mesh_info.h"
#include "hp/fsdp/options.h"
#include "hp/fsdp/param_group.h"
#include "hp/fsdp/root_context.h"
#include "hp/fsdp/unit_grads.h"
#include "hp/nn/module.h"

namespace hp::trace {
class GpuMark;
}

namespace hp::fsdp {

// The key under which a module carries its unit (nn::Module::attachment).
constexpr const char* kUnitAttachment = "hp.fsdp.unit";

class Unit;

// The distinct units attached to the modules inside `module` (and to
// `module` itself with include_self), in module order.
std::vector<std::shared_ptr<Unit>> units_in_tree(const nn::Module& module, bool include_self = true);

struct UnitFlags {
  // As the user gave it (options.h); nullopt is resolved by
  // Unit::ranks_after_forward() once the root is known.
  ReshardAfterForward reshard_after_forward;
  // An explicit setting's ranks the parameters stay spread over after
  // forward: the shard size (true), 1 (false) or N in between.
  int64_t reshard_after_forward_ranks = 0;
  // false: the end of backward points the parameters back at their shards
  // but keeps the gathered copy; the next gather reuses it unless the shards
  // changed since (an optimizer step, a load): see Unit::begin_unshard.
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool average = true;  // reduce op "avg" (else "sum")
  bool implicit_prefetch = true;
};

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  enum class State { kIdle, kForward, kAfterForward, kPreBackward, kPipeline };

  // `regather_group`: the group of reshard_after_forward = N ranks this rank
  // belongs to (null unless 1 < N < shard size); made by the caller before
  // any parameter was sharded, since making it is collective.
  Unit(std::vector<std::shared_ptr<nn::Module>> modules, MeshInfo mesh,
       std::vector<std::unique_ptr<FSDPParam>> params, UnitFlags flags,
       MixedPrecisionPolicy mp, ParamGroup::Options group_options,
       dist::GroupPtr regather_group);
  ~Unit();

  // Registers the forward hooks on the modules and the post-accumulate hooks
  // on the parameters. Called once, right after construction.
  void install_hooks();

  // The unit's modules that are still alive (they own the unit, so the unit
  // refers to them weakly: no cycle keeps a model alive).
  std::vector<std::shared_ptr<nn::Module>> modules() const;
  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const MeshInfo& mesh() const { return mesh_; }
  // Deferred initialisation (materialize.h): gives every parameter still on
  // meta its (uninitialised) shard on the unit's device. Returns the
  // replaced parameter tensors as (old, new): a plain meta parameter's
  // TensorImpl cannot hold real memory, so the caller re-registers the new
  // one in the model (the registry already maps it to its FSDPParam).
  // Nothing on meta: nothing happens. Local: no collectives.
  std::vector<std::pair<at::Tensor, at::Tensor>> materialize();
  const UnitFlags& flags() const { return flags_; }
  // FSDPModule's setters; each takes effect at the next hook that reads it.
  // (reshard_after_forward has its own, below: it needs a group.)
  void set_requires_gradient_sync(bool value) { flags_.requires_gradient_sync = value; }
  void set_requires_all_reduce(bool value) { flags_.requires_all_reduce = value; }
  void set_reshard_after_backward(bool value) { flags_.reshard_after_backward = value; }
  void set_average(bool value) { flags_.average = value; }
  void set_implicit_prefetch(bool value) { flags_.implicit_prefetch = value; }
  // Whether the tree's next backward completes its reductions: one setting
  // per tree, held by its root context (RootContext::is_last_backward).
  // Before the unit joins a root it is kept here, and a false on any unit
  // of a tree holds for the root it joins.
  void set_is_last_backward(bool value);
  bool is_last_backward_before_root() const { return is_last_backward_before_root_; }
  const std::shared_ptr<RootContext>& context() const { return context_; }
  // The context, made now with this unit as the root of its tree when no
  // forward has made one yet (RootContext::create, which checks the tree).
  const std::shared_ptr<RootContext>& context_or_become_root();
  bool is_root() const { return context_ && &context_->root() == this; }
  // The root of a tree with other units: its parameters serve both ends of
  // backward (head first, embeddings last).
  bool root_of_others() const { return is_root() && context_->has_other_units(); }
  // A short name for messages: the first module's name.
  const std::string& name() const { return name_; }

  // The group a unit sharded over `mesh` regathers in after forward with
  // reshard_after_forward = `ranks` (null when it gathers over the whole
  // shard group or not at all). Collective over the shard group: every rank
  // asks for the same `ranks`. Raises unless `ranks` is a divisor of the
  // shard size (1 keeps the parameters gathered, the shard size reshards
  // them fully).
  static void check_reshard_after_forward(int64_t ranks, int64_t shard_size,
                                          const std::string& unit_name);
  static dist::GroupPtr regather_group_for(const MeshInfo& mesh, int64_t ranks);
  // The ranks the parameters stay spread over after a forward that a
  // backward follows: the explicit setting's, else 1 for the root (its
  // backward follows at once) and the shard size for any other unit.
  int64_t ranks_after_forward() const;
  // Raises unless the setting can change now: not while the parameters
  // hold pieces for a regather or a gather is in flight (between forward
  // and backward), since those were made for the current setting.
  void check_can_change_reshard_after_forward() const;
  // A new setting (ranks: the explicit setting's, see UnitFlags), with its
  // group (regather_group_for).
  void set_reshard_after_forward(ReshardAfterForward setting, int64_t ranks,
                                 dist::GroupPtr regather_group);
  // Explicit prefetch lists (F11); they replace the implicit choice.
  void set_forward_prefetch(std::vector<std::weak_ptr<Unit>> units);
  void set_backward_prefetch(std::vector<std::weak_ptr<Unit>> units);

  // Explicit unshard/reshard (F9). A user's asynchronous unshard gathers
  // from copies of the shards (`snapshot`), so an optimizer step before
  // wait() cannot race with the gather reading them. A copy kept by
  // reshard_after_backward = false is used instead of a gather while the
  // shards are unchanged since it was gathered; once they changed, the unit
  // gathers again (and says so in the trace, once per unit).
  void begin_unshard(bool snapshot = false);
  // `keep_output`: the unit's forward, whose all-gather output the tree keeps
  // until the next unit's unshard (comm_context.h); else released at once.
  void wait_unshard(bool keep_output = false);
  // Frees the gathered parameters; with `keep_copies` a copy kept after
  // backward stays (for callers that only read the shards: state_dict).
  void reshard(bool keep_copies = false);

  // Drops every gradient of the unit's parameters (F14 zero_grad).
  void zero_grad();

  // The device the unit's parameters compute on (CPU for a unit without any).
  c10::Device compute_device() const;

 private:
  friend class RootContext;

  std::optional<nn::TensorList> pre_forward(nn::Module& module, const nn::TensorList& inputs);
  std::optional<nn::TensorList> post_forward(nn::Module& module, const nn::TensorList& outputs);
  void on_forward_error(nn::Module& module, const std::exception_ptr& error);
  void pre_backward();
  void post_accumulate(FSDPParam& param);
  // comm_fusion reduces whole parameters over the whole mesh in one
  // all-reduce, so it cannot stop short of the replicas: while all-reduce
  // is off (HSDP, DDP) their gradients are kept unreduced instead and join
  // the next backward's bucket.
  bool keeps_whole_grads_unreduced() const;
  void reduce_fused();
  // A parameter's (or, fused, the group's) reshard at the end of its
  // backward: freed, or kept for the next forward (reshard_after_backward).
  void reshard_after_backward(FSDPParam& param);
  void reshard_after_backward();
  // The unit's part of the end of backward.
  void finish_backward();
  // A pipeline step (root_context.h). Once gathered: earlier gradients
  // stashed, kPipeline. At its end: the step's whole gradients through
  // post-accumulate, as if one backward had delivered them, leaving the
  // unit in kPreBackward for finish_backward().
  void enter_pipeline_step();
  void reduce_pipeline_grads();
  void validate_for_training() const;
  void prefetch(const std::vector<std::weak_ptr<Unit>>& explicit_units, int offset);
  void complete_own_reductions();
  // The trace's spans of this unit's forward or backward compute: the host's
  // and, on a GPU, the compute stream's (gpu_trace.h). The start forgets an
  // earlier one while tracing is off; the end is called only while tracing.
  void trace_compute_start();
  void trace_compute_end(const char* what);
  std::shared_ptr<trace::GpuMark> compute_mark() const;
  // Back to kIdle with the parameters resharded and nothing in flight;
  // false if a gather in flight could not be waited for.
  bool reset_after_failure(bool drop_grads) noexcept;
  // Runs `step` of a backward hook; a collective failure makes the tree
  // unusable before the exception reaches autograd's engine.
  template <typename Fn>
  void in_backward(const char* what, Fn&& step);

  std::vector<std::weak_ptr<nn::Module>> modules_;
  std::string name_;
  MeshInfo mesh_;
  std::vector<std::unique_ptr<FSDPParam>> params_;
  UnitFlags flags_;
  MixedPrecisionPolicy mp_;
  ParamGroup group_;
  dist::GroupPtr regather_group_;  // reshard_after_forward = N
  std::shared_ptr<RootContext> context_;
  std::vector<nn::HookHandle> hook_handles_;
  std::vector<std::weak_ptr<Unit>> forward_prefetch_;
  std::vector<std::weak_ptr<Unit>> backward_prefetch_;

  // Nothing to gather, cast or reduce (one rank, no replicas, no mixed
  // precision, no main grads): the hooks only keep the shared bookkeeping,
  // and gradients stay where autograd put them.
  bool communicates_ = true;
  bool is_last_backward_before_root_ = true;  // until context_ exists
  State state_ = State::kIdle;
  // In kForward: the unit's modules that have not finished their call yet.
  // A list unit gathers once, at the first of its modules to run, and
  // reshards after the last (all must run).
  std::vector<const nn::Module*> modules_to_run_;
  UnitGrads grads_;
  bool stale_copy_traced_ = false;  // the trace said once that a kept copy was stale
  int64_t compute_start_us_ = 0;  // trace: start of this unit's forward / backward compute
  std::shared_ptr<trace::GpuMark> gpu_compute_start_;  // trace: its mark on the compute stream
};

}  // namespace hp::fsdp
