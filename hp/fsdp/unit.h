// A fully_shard unit: the parameters of one module (or a list of modules)
// that are gathered, resharded and reduced together (SPEC F4, F9, F10, F15).
//
// Hooks drive the lifecycle:
//   pre-forward   gather the unit's shards, point the parameters at them
//   post-forward  release the gathered memory (reshard_after_forward) and
//                 hook the outputs' gradients
//   pre-backward  (first output gradient) gather again into the same storage,
//                 stash earlier shard gradients
//   post-accumulate (per parameter) take the full gradient, reshard the
//                 parameter, queue its reduction
//   end of backward (root callback) reshard what got no gradient, complete
//                 the reductions, reset.
// The first unit whose forward runs becomes the root of the units in its
// module tree (lazy initialisation): it validates them and owns the shared
// context (execution order, reduction queue, the end-of-backward callback).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/mesh_info.h"
#include "hp/fsdp/reduction.h"
#include "hp/nn/module.h"

namespace hp::fsdp {

// The key under which a module carries its unit (nn::Module::attachment).
constexpr const char* kUnitAttachment = "hp.fsdp.unit";

class Unit;

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
};

struct UnitFlags {
  bool reshard_after_forward = true;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;
  bool average = true;  // reduce op "avg" (else "sum")
  // Read on the root: whether this backward completes its reductions.
  bool is_last_backward = true;
};

class Unit : public std::enable_shared_from_this<Unit> {
 public:
  Unit(std::vector<std::shared_ptr<nn::Module>> modules, MeshInfo mesh,
       std::vector<std::unique_ptr<FSDPParam>> params, UnitFlags flags);
  ~Unit();

  // Registers the forward hooks on the modules and the post-accumulate hooks
  // on the parameters. Called once, right after construction.
  void install_hooks();

  const std::vector<std::shared_ptr<nn::Module>>& modules() const { return modules_; }
  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const MeshInfo& mesh() const { return mesh_; }
  UnitFlags& flags() { return flags_; }
  const std::shared_ptr<RootContext>& context() const { return context_; }
  bool is_root() const { return context_ && context_->root == this; }
  // A short name for messages: the first module's name.
  std::string name() const;

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
  void finish_backward();
  void become_root();
  void validate_for_training() const;

  enum class State { kIdle, kForward, kAfterForward, kPreBackward };

  std::vector<std::shared_ptr<nn::Module>> modules_;
  MeshInfo mesh_;
  std::vector<std::unique_ptr<FSDPParam>> params_;
  UnitFlags flags_;
  std::shared_ptr<RootContext> context_;
  std::vector<nn::HookHandle> hook_handles_;

  State state_ = State::kIdle;
  int forward_depth_ = 0;        // list units: modules inside forward
  int64_t wave_ = -1;            // post-backward order in this backward
  std::vector<dist::Work> unshard_works_;
  bool unshard_in_flight_ = false;

  friend struct RootContext;
};

}  // namespace hp::fsdp
