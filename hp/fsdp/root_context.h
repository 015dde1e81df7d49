// What the root unit shares with every unit of its module tree: the lazy
// initialisation, the recorded forward order (implicit prefetch), the queue
// of gradient reductions, the end of backward, and what happens after a
// failure.
//
// Lazy initialisation: the first unit whose forward runs becomes the root of
// the units in its modules' trees; it checks them and they share one context.
//
// End of backward: the first unit to start its backward queues a callback
// with autograd's engine; it reduces what is left, reshards and resets every
// unit. torch's engine drops the queued callbacks of a backward that raised
// (in a user's hook, an operator or one of ours) without running them, so
// the callback holds a guard whose destructor sees that and recovers
// instead (abandon_backward).
//
// Failures leave the tree in one of two states:
//   recovered  an exception in a forward (a user's module, a bad batch) or a
//              backward that raised: every unit is resharded and idle, no
//              gather is in flight, a backward's gradients are dropped (they
//              would be partial); the next step trains as if the failed one
//              had not happened, provided every rank failed at the same point.
//   unusable   a collective failed (timeout, dead peer) or could not be
//              waited for: the ranks may be at different points of the
//              step, so every later forward, backward or unshard raises an
//              UnusableError that says why; the model and process group
//              must be rebuilt (e.g. reloaded from a checkpoint).
//
// Pipeline steps: between begin_pipeline_step and finish_pipeline_step
// every unit stays gathered and no backward ends anything (no callback is
// queued): the micro-batches' forwards and backwards, split or not, run in
// any interleaving, and their gradients accumulate whole in .grad until
// finish_pipeline_step reduces them as one backward's. A forward that
// raises in the step, or cancel_pipeline_step, drops the step's gradients
// and leaves the tree resharded and idle (recovered, as above).
//
// Threads: as the units' hooks (unit.h). The end-of-backward callback runs
// on the autograd engine's thread that ran the backward, after its last
// hook, before backward() returns; the guard's recovery runs where the
// engine drops the callback, also before backward() returns.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "hp/fsdp/comm_context.h"
#include "hp/fsdp/reduction.h"
#include "hp/nn/module.h"
#include "hp/util/error.h"

namespace hp::fsdp {

class Unit;

class RootContext : public std::enable_shared_from_this<RootContext> {
 public:
  // Makes `root` the root of every unit in its modules' trees (that has no
  // root yet) and checks them for training. Raises before changing anything
  // if a unit of the tree is in the middle of another root's step.
  static std::shared_ptr<RootContext> create(Unit& root);

  Unit& root() const { return *root_; }
  // Root first, then the others in module order.
  const std::vector<std::weak_ptr<Unit>>& units() const { return units_; }
  // A tree with other units than the root (its parameters serve both ends
  // of backward).
  bool has_other_units() const { return units_.size() > 1; }

  // --- execution order (recorded during the first forward) ---
  // Each unit's pre-forward and post-forward, in the order they ran.
  void record_forward(Unit* unit);
  void record_post_forward(Unit* unit);
  void finish_recording() { forward_order_recorded_ = true; }
  bool forward_order_recorded() const { return forward_order_recorded_; }
  // The unit whose forward starts after `unit`'s: forward prefetch.
  Unit* next_in_forward(const Unit* unit) const;
  // The unit whose forward ended just before `unit`'s: backward runs in
  // reverse post-forward order, so that unit's backward comes next. The root,
  // whose forward ends last, thus starts the last block's gather when its
  // own backward begins (the head's backward hides it), not the block itself.
  Unit* next_in_backward(const Unit* unit) const;

  // --- the first training forward: did every unit it used run its hooks? ---
  // (hook_check.h) The root's pre-forward starts a forward, every unit's
  // notes that it ran; the root's post-forward checks, once, at the first
  // forward that a backward follows, and raises ArgumentError naming a unit
  // whose parameters are in `outputs`' graph but whose pre-forward did not
  // run.
  void begin_forward() { ran_.clear(); }
  void note_pre_forward(const Unit* unit) {
    if (!hooks_checked_) ran_.push_back(unit);
  }
  void check_hooks_ran(const nn::TensorList& outputs);

  // --- streams (comm_context.h) ---
  // The tree's CommContext, created at the root's first forward on the
  // device of the root's parameters (null before).
  CommContext* comm() const { return comm_.get(); }
  // The root's pre-forward: creates the CommContext if needed, lands the
  // reductions a backward left pending, and starts an iteration.
  void begin_iteration(c10::Device device);

  // --- backward ---
  ReductionQueue& reductions() { return reductions_; }
  // Whether this backward completes its reductions (else they stay in
  // flight until the next forward or wait_for_gradients): the tree's one
  // setting, FSDPModule::set_is_last_backward through any of its units.
  bool is_last_backward() const { return is_last_backward_; }
  void set_is_last_backward(bool value) { is_last_backward_ = value; }
  // The position of a unit's first gradient in this backward.
  int64_t take_wave() { return next_wave_++; }
  // Queues the end-of-backward callback once per backward (called from
  // inside backward, by the first unit whose backward starts). Before that,
  // raises ArgumentError (with the tree reset, gradients kept) if this
  // backward computes gradients of the tree's parameters without
  // accumulating them (torch::autograd::grad): see check_accumulates().
  void ensure_end_of_backward();

  // Completes every pending reduction (FSDPModule::wait_for_gradients);
  // raises ArgumentError during a backward of the tree, UnusableError if the
  // tree is unusable; a collective failure makes it unusable.
  void wait_for_gradients();

  // --- pipeline steps (FSDPModule::begin_pipeline_step) ---
  // Gathers every unit (collective over each unit's shard group, in the
  // tree's order), stashes earlier gradients. ArgumentError, changing
  // nothing, while a unit is between its forward and backward or a step is
  // already open.
  void begin_pipeline_step();
  // Reduces the step's gradients (every unit's, in the tree's order), as
  // the end of one backward; ArgumentError without an open step.
  void finish_pipeline_step();
  // Local: the step's gradients dropped, earlier ones back, every unit
  // resharded and idle. Nothing happens without an open step.
  void cancel_pipeline_step() noexcept;
  bool in_pipeline_step() const { return pipeline_step_; }

  // --- failures ---
  // Raises UnusableError if a failure made the tree unusable.
  void check_usable() const;
  // Records that `what` failed with a collective error: unusable from now on.
  void mark_unusable(const std::string& what, const std::exception_ptr& error);
  // An exception left the root's forward: every unit back to resharded, idle.
  void recover_from_forward_error(const std::exception_ptr& error) noexcept;
  // A backward raised: see the file comment. Also called when the
  // end-of-backward callback itself raised.
  void abandon_backward() noexcept;

 private:
  struct EndOfBackwardGuard;

  void finish_backward();
  void check_accumulates();
  // Waits for what is in flight and reshards every unit; false (and the
  // tree unusable) if a collective could not be waited for.
  void reset_units(bool drop_grads) noexcept;
  // After a failure: the kept stream buffers go, each after its waits.
  void release_stream_buffers() noexcept;

  Unit* root_ = nullptr;
  std::vector<std::weak_ptr<Unit>> units_;
  std::vector<Unit*> forward_order_;
  std::vector<Unit*> post_forward_order_;
  bool forward_order_recorded_ = false;
  bool backward_in_flight_ = false;
  bool pipeline_step_ = false;
  bool is_last_backward_ = true;
  int64_t next_wave_ = 0;
  ReductionQueue reductions_;
  std::unique_ptr<CommContext> comm_;
  std::string unusable_reason_;
  bool hooks_checked_ = false;
  std::vector<const Unit*> ran_;
};

}  // namespace hp::fsdp
