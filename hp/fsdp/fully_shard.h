// fully_shard: sharded data parallelism for hookable modules (F1-F15).
//
//   hp::nn::GPT model(config);
//   for (auto& block : model->blocks()) hp::fully_shard(block.ptr());   // inner units first
//   hp::FSDPModule fsdp = hp::fully_shard(model.ptr());                // the root
//   torch::optim::AdamW optimizer(model->parameters(), options);
//   ...  loss = hp::nn::cross_entropy(model(x), y); loss.backward(); optimizer.step();
//
// Each call makes the module (or the list of modules, as one unit) a unit:
// its parameters not already owned by an inner unit are sharded in place
// along dim 0 (uneven sizes padded) over the mesh's shard dim, and hooks
// gather them for forward and backward and reduce their gradients. The
// registered parameters keep their identity, so an optimizer built from
// model->parameters() steps the local shards (F6). Arguments are validated
// before anything is communicated; building units is collective: every rank
// calls fully_shard on the same modules in the same order. A unit must be
// called through its hooks (`block(x)`, hp::nn::Sequential; a torch::nn
// module wrapped by hp::nn::hooked): one inside a torch::nn::Sequential, or
// found in the first training forward's graph without its pre-hook having
// run, raises ArgumentError naming it (hook_check.h).
// Over a model on the meta device nothing is allocated: the shards stay
// meta until init_sharded or load_into_shards materialises them
// (materialize.h, F17).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "hp/fsdp/options.h"
#include "hp/fsdp/state_dict.h"
#include "hp/nn/module.h"

namespace hp {

namespace fsdp {
class Unit;
}

class FSDPModule;

// Waits for an asynchronous unshard (F9).
class UnshardHandle {
 public:
  UnshardHandle() = default;
  explicit UnshardHandle(std::vector<std::shared_ptr<fsdp::Unit>> units) : units_(std::move(units)) {}
  void wait();

 private:
  std::vector<std::shared_ptr<fsdp::Unit>> units_;
};

// The fully_shard interface of a module (FSDP2's FSDPModule methods).
class FSDPModule {
 public:
  // The handle of a module that fully_shard made a unit; raises otherwise.
  explicit FSDPModule(std::shared_ptr<nn::Module> module);

  nn::Module& module() const { return *module_; }
  const std::shared_ptr<nn::Module>& module_ptr() const { return module_; }

  // Gathers this unit's parameters (not its sub-units'); with async_op the
  // returned handle's wait() finishes it (the next forward waits too). An
  // asynchronous gather reads a copy of the shards taken here, so an
  // optimizer step before wait() does not race with it: the gathered
  // parameters are those of the moment unshard() was called.
  UnshardHandle unshard(bool async_op = false);
  void reshard();

  // F10. With recurse (the default) they apply to every unit in the module's
  // tree, else to this unit only.
  void set_requires_gradient_sync(bool requires_gradient_sync, bool recurse = true);
  // requires_all_reduce = false (HSDP, DDP): gradients are reduced over
  // the shard ranks only and accumulate until a backward with all-reduce;
  // with comm_fusion, the parameters kept whole are not reduced at all
  // meanwhile (options.h, comm_fusion).
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  // reshard_after_forward (options.h says what each setting costs) can
  // change only while no unit it applies to is between its forward and its
  // backward (raises otherwise, changing nothing). An int N keeps the
  // parameters gathered within groups of N ranks after forward (a divisor of
  // the shard size), so backward gathers only inside them; making those
  // groups is collective: every rank of the shard group calls it with the
  // same value. std::nullopt restores the default (the root keeps, others
  // free).
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true);
  void set_reshard_after_forward(int64_t ranks, bool recurse = true);
  void set_reshard_after_forward(const ReshardAfterForward& setting, bool recurse = true);
  // This unit's setting as given (std::nullopt: the default).
  ReshardAfterForward reshard_after_forward() const;
  // false: at the end of backward the parameters hold their shards again
  // (the optimizer steps them, clip_grad_norm_ and state_dict read them),
  // but the gathered copies keep their memory, and the next forward (or
  // unshard()) uses them instead of gathering, as FSDP2 does during
  // gradient accumulation: with set_requires_gradient_sync(false) or, on
  // HSDP, set_requires_all_reduce(false) micro-batches, the unit gathers once
  // per accumulation window. Costs the unit's unsharded size between
  // backward and the next forward. Set it back to true for the last
  // micro-batch, so the optimizer's step is not followed by a forward over
  // a stale copy; should the shards change while a copy is kept anyway (a
  // step, load_state_dict, a write through the parameter), the next forward
  // sees it in the shards' version counters and gathers again, and the
  // trace says so once per unit. Writes through param.data() (a tensor with
  // a version counter of its own) are not seen.
  void set_reshard_after_backward(bool reshard_after_backward, bool recurse = true);
  // Whether the coming backward is the last before the optimizer step; when
  // false its reductions complete at the next forward, at reshard() of a
  // unit they cover, or at wait_for_gradients(). One setting for the whole
  // tree: set through any unit, it applies to its root.
  void set_is_last_backward(bool is_last_backward);
  // Completes every gradient reduction still pending in the tree this unit
  // belongs to (after a backward under set_is_last_backward(false)), so
  // that .grad, and the main grads under apply_grad_on_fp32_main_grad, hold
  // their reduced values when it returns.
  //   nothing pending  (a last backward, a second call, no forward yet):
  //                    returns at once and communicates nothing.
  //   not the root     the reductions of a tree share its root's queue, so
  //                    called through any unit it completes the whole tree's
  //                    (what the root's next forward would complete).
  //   threads          not thread-safe: call it from the thread that drives
  //                    the tree's forward and backward, between backward()
  //                    and the optimizer step; during a backward of the tree
  //                    (from a hook) it raises ArgumentError, waiting for
  //                    nothing.
  //   errors           UnusableError if the tree is already unusable; a
  //                    collective that fails while it waits makes the tree
  //                    unusable (root_context.h) and its error propagates.
  // Gradients kept aside by set_requires_gradient_sync(false) or
  // set_requires_all_reduce(false) are not pending: they wait for a
  // backward that synchronises.
  void wait_for_gradients();
  // Pipeline steps (docs/pipeline.md, "fully_shard inside stages"): the
  // forwards and backwards of several micro-batches, in whatever order a
  // pipeline schedule runs them, then one reduction, as FSDP2 does under
  // torch.distributed.pipelining.
  //   begin_pipeline_step()  gathers every unit of this tree (collective
  //                          over each unit's shard group, as a forward's
  //                          gathers) and keeps them gathered: until the
  //                          step ends, forwards gather and free nothing,
  //                          and backward() calls, or the engine calls of
  //                          a backward split into its input and weight
  //                          halves, end nothing and reduce nothing: the
  //                          gradients accumulate whole in .grad. Gradients
  //                          from before the step wait aside.
  //   finish_pipeline_step() reduces the accumulated gradients as the end of
  //                          one backward does (the settings above apply:
  //                          with set_requires_gradient_sync(false) they
  //                          are kept for a later step; HSDP all-reduces),
  //                          reshards, adds the earlier gradients back;
  //                          every unit idle.
  //   cancel_pipeline_step() after a failure in the step: drops its
  //                          gradients, reshards, every unit idle; local,
  //                          communicates nothing; nothing without a step.
  // Memory: for the whole step the tree holds its unsharded parameters and
  // their unsharded gradients (in the compute and reduce dtypes), where a
  // plain step holds them one unit at a time; the micro-batches' gathers
  // and reductions happen once per step instead of once per micro-batch.
  // Call them on the tree's root module (the outermost fully_shard), between
  // steps (not while a unit is between its forward and backward:
  // ArgumentError, nothing changed). A forward that raises inside the step
  // cancels it; UnusableError and collective failures as everywhere else.
  void begin_pipeline_step();
  void finish_pipeline_step();
  void cancel_pipeline_step() noexcept;

  // "avg" (default: divide by the data-parallel size) or "sum" (F5). With
  // recurse (the default) it applies to every unit in the module's tree,
  // else to this unit only. Recursive by default, unlike FSDP2-style
  // setters that change one unit: one call on the root sets the model's
  // reduction, as the F10 setters do, where a per-unit default would leave
  // the inner units averaging.
  //
  // Tensor-parallel (DTensor) parameters average too, where FSDP2-style
  // libraries may sum by default on their DTensor paths: here every
  // data-parallel rank's loss is the mean over its own slice, for DTensor
  // parameters as for plain ones, so the average over dp is the gradient of
  // the global batch's mean for both, and one default serves a unit that
  // holds both (docs/features.md, F5).
  void set_reduce_op_type(const std::string& reduce_op_type, bool recurse = true);

  // F11. Implicit prefetch (on by default): forward gathers the next unit in
  // the recorded execution order while this one computes, backward the one
  // before it. Explicit lists replace the implicit choice for this unit.
  void set_implicit_prefetch(bool enabled, bool recurse = true);
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);

  // Drops every gradient of the tree's managed parameters (F14).
  void zero_grad();

  // Local shards as DTensors under their fully-qualified names (F14).
  StateDict state_dict() const;
  // Accepts DTensors, local-shape or global-shape tensors per key; strict
  // raises on missing or unexpected keys, listing them.
  void load_state_dict(const StateDict& state_dict, bool strict = true);

 private:
  std::vector<std::shared_ptr<fsdp::Unit>> units(bool recurse) const;
  std::shared_ptr<fsdp::Unit> unit() const;

  std::shared_ptr<nn::Module> module_;
};

// Parameters that are already DTensors (tensor parallelism, F16) need
// options.mesh: a data-parallel sub-mesh of the mesh their layouts live on.
// Without one fully_shard raises ArgumentError naming the parameter, its
// mesh and the call to make instead; units over the parameters' own mesh
// (gradients all-reduced over its replicated dims) are not supported. For
// tensor parallelism alone, build the mesh with a data-parallel dim of size
// 1: init_device_mesh("cpu", {1, tp}, {"dp", "tp"}), shard_module over
// mesh["tp"], then options.mesh = mesh["dp"] (docs/features.md, F16).
FSDPModule fully_shard(const std::shared_ptr<nn::Module>& module,
                       const FullyShardOptions& options = {});
// The modules form one unit (their parameters are gathered together).
FSDPModule fully_shard(const std::vector<std::shared_ptr<nn::Module>>& modules,
                       const FullyShardOptions& options = {});

// Whether `module` is a fully_shard unit.
bool is_fully_sharded(const nn::Module& module);

// The fp32 main gradient of a parameter managed by a unit built with
// MixedPrecisionPolicy::apply_grad_on_fp32_main_grad: the reduced gradient
// shard, accumulated over backwards until zero_grad (undefined before the
// first). Raises for a parameter fully_shard does not manage.
at::Tensor main_grad(const at::Tensor& param);

}  // namespace hp
