// A fully_shard unit: the parameters of one module (or a list of modules)
// that are gathered, resharded and reduced together (SPEC F4, F9-F12, F15).
//
// Hooks drive the lifecycle:
//   pre-forward   gather the unit's shards (or wait for a prefetch), point the
//                 parameters at them, prefetch the next unit, cast inputs
//   post-forward  release the gathered memory (reshard_after_forward: true
//                 frees, N keeps pieces for a group of N ranks), hook the
//                 outputs' gradients, cast outputs
//   pre-backward  (first output gradient) gather again into the same
//                 storage, prefetch the previous unit, stash earlier grads
//   post-accumulate (per parameter) take the full gradient; without fusion
//                 reshard that parameter and queue its reduction, with fusion
//                 queue the unit's once all its gradients are in
//   end of backward (root callback) reduce what is left, reshard, complete
//                 the reductions, reset.
// The first unit whose forward runs becomes the root of the units in its
// module tree (lazy initialisation): it validates them and owns the shared
// context (execution order, reduction queue, the end-of-backward callback).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/mesh_info.h"
#include "hp/fsdp/options.h"
#include "hp/fsdp/param_group.h"
#include "hp/fsdp/reduction.h"
#include "hp/nn/module.h"

namespace hp::fsdp {

// The key under which a module carries its unit (nn::Module::attachment).
constexpr const char* kUnitAttachment = "hp.fsdp.unit";

class Unit;

// The distinct units attached to the modules inside `module` (and to
// `module` itself with include_self), in module order.
std::vector<std::shared_ptr<Unit>> units_in_tree(const nn::Module& module, bool include_self = true);

// Shared by the root unit and every unit in its module tree.
struct RootContext {
  Unit* root = nullptr;
  std::vector<std::weak_ptr<Unit>> units;  // root first, then in module order
  std::vector<Unit*> forward_order;        // recorded during the first forward
  bool forward_order_recorded = false;
  bool callback_queued = false;
  int64_t next_wave = 0;
  ReductionQueue reductions;

  // The end-of-backward callback.
  void finish_backward();
  // The unit after (offset 1) or before (-1) `unit` in forward order.
  Unit* neighbour(const Unit* unit, int offset) const;
};

struct UnitFlags {
  // Ranks the parameters stay spread over after forward: the shard size
  // (true: reshard), 1 (false: keep them gathered) or N in between.
  int64_t reshard_after_forward_ranks = 0;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool average = true;  // reduce op "avg" (else "sum")
  bool implicit_prefetch = true;
  // Read on the root: whether this backward completes its reductions. Set
  // through any unit of the tree (FSDPModule::set_is_last_backward sets the
  // root's too; before the first forward a false on any unit of the tree
  // holds for the root it joins).
  bool is_last_backward = true;
};

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(std::vector<std::shared_ptr<nn::Module>> modules, MeshInfo mesh,
       std::vector<std::unique_ptr<FSDPParam>> params, UnitFlags flags,
       MixedPrecisionPolicy mp, ParamGroup::Options group_options);
  ~Unit();

  // Registers the forward hooks on the modules and the post-accumulate hooks
  // on the parameters. Called once, right after construction.
  void install_hooks();

  // The unit's modules that are still alive (they own the unit, so the unit
  // refers to them weakly: no cycle keeps a model alive).
  std::vector<std::shared_ptr<nn::Module>> modules() const;
  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const MeshInfo& mesh() const { return mesh_; }
  const UnitFlags& flags() const { return flags_; }
  UnitFlags& mutable_flags() { return flags_; }
  const std::shared_ptr<RootContext>& context() const { return context_; }
  bool is_root() const { return context_ && context_->root == this; }
  // The root of a tree with other units: its parameters serve both ends of
  // backward (head first, embeddings last).
  bool root_of_others() const { return is_root() && context_->units.size() > 1; }
  // A short name for messages: the first module's name.
  std::string name() const;

  // Raises unless `ranks` is a valid reshard_after_forward for a unit named
  // `unit_name` sharded over `shard_size` ranks: a divisor of it (1 keeps
  // the parameters gathered, shard_size reshards fully). Used before any
  // change by fully_shard and the setter, and by set_reshard_after_forward.
  static void check_reshard_after_forward(int64_t ranks, int64_t shard_size,
                                          const std::string& unit_name);
  // reshard_after_forward as bool or N (validated: N divides the shard size).
  void set_reshard_after_forward(int64_t ranks);
  // Explicit prefetch lists (F11); they replace the implicit choice.
  void set_forward_prefetch(std::vector<std::weak_ptr<Unit>> units);
  void set_backward_prefetch(std::vector<std::weak_ptr<Unit>> units);

  // Explicit unshard/reshard (F9).
  void begin_unshard();
  void wait_unshard();
  void reshard();

  // Drops every gradient of the unit's parameters (F14 zero_grad).
  void zero_grad();

 private:
  std::optional<nn::TensorList> pre_forward(const nn::TensorList& inputs);
  std::optional<nn::TensorList> post_forward(const nn::TensorList& outputs);
  void pre_backward();
  void post_accumulate(FSDPParam& param);
  void start_packing();
  void reduce_fused();
  void finish_backward();
  void become_root();
  void validate_for_training() const;
  void prefetch(const std::vector<std::weak_ptr<Unit>>& explicit_units, int offset);
  void complete_own_reductions();

  enum class State { kIdle, kForward, kAfterForward, kPreBackward };

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
  State state_ = State::kIdle;
  int forward_depth_ = 0;  // list units: modules inside forward
  int64_t wave_ = -1;      // post-backward order in this backward
  int64_t grads_expected_ = 0;
  int64_t grads_arrived_ = 0;
  int64_t compute_start_us_ = 0;  // trace: start of this unit's forward / backward compute
  // Fused: this backward's gradients, packed as they arrive.
  PackedGrads packed_sharded_;
  PackedGrads packed_whole_;
  // Fused root of other units: its gradients arrive at both ends of backward
  // (head first, embeddings last), so they wait here as they are and are
  // packed with the last; packing the first would hold the whole root's
  // buffer through every other unit's backward.
  std::vector<std::pair<FSDPParam*, at::Tensor>> unpacked_;

  friend struct RootContext;
};

}  // namespace hp::fsdp
