// One parameter managed by fully_shard: its shard, its unsharded buffer and
// its gradient bookkeeping (docs/design.md follows it through a step).
//
// The registered parameter's TensorImpl is never replaced, so the user's
// optimizer keeps working on it. Between steps it holds this rank's shard
// (the torch.chunk piece of dim 0, or of the dim shard_placement_fn chose)
// in its original dtype, as a view into a zero-padded shard buffer, so every
// rank gathers the same number of elements. For compute it points at the
// unsharded buffer, in the compute dtype (mixed precision's param_dtype);
// after forward that buffer's memory can be released while the parameter
// keeps its full shape (autograd's saved views stay valid), and it is
// refilled into the same storage before backward.
//
// The param gathers, copies out and reshards itself; which collectives carry
// its data (one per parameter, or one per unit) is the ParamGroup's choice.
//
// A parameter that is a tensor-form DTensor (tensor parallelism sharded it;
// dtensor_param.h) is handled through its local tensor: everything below
// (shapes, shards, buffers, gradients) is about that local tensor, and the
// parameter itself is pointed at DTensors wrapping it: the parameter's own
// layout for compute, shard_layout() between steps. Its .grad is a DTensor
// the same way.
//
// Threads: called from its unit's hooks (unit.h), one thread at a time; the
// post-accumulate hook runs on the autograd engine's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/work.h"
#include "hp/fsdp/mesh_info.h"
#include "hp/fsdp/options.h"
#include "hp/tensor/layout.h"
#include "hp/util/torch_compat.h"

namespace torch::autograd {
struct Node;
}

namespace hp::fsdp {

class FSDPParam {
 public:
  // Shards `param` in place. `replicated` keeps it whole (replicate_params);
  // a shard group of one rank keeps it whole too.
  // With a CPU `offload` policy and a parameter on a CUDA device, the shard
  // (and its gradient, so the optimizer step) lives in host memory, pinned
  // if asked, and only the unsharded buffer on the device (F8); on a CPU
  // parameter there is nothing to move. Parameters kept whole stay put.
  FSDPParam(at::Tensor param, std::string fqn, const MeshInfo& mesh, int64_t shard_dim,
            bool replicated, const MixedPrecisionPolicy& mp, const OffloadPolicy& offload = {});
  // The dtypes a parameter of dtype `orig` computes and reduces in under
  // `mp`: no cast when param_dtype is the parameter's own; gradients are
  // reduced in reduce_dtype, else in the compute dtype (F7). fully_shard
  // checks them before any parameter is built.
  static at::ScalarType compute_dtype_for(at::ScalarType orig, const MixedPrecisionPolicy& mp);
  static at::ScalarType reduce_dtype_for(at::ScalarType orig, const MixedPrecisionPolicy& mp);

  FSDPParam(const FSDPParam&) = delete;
  FSDPParam& operator=(const FSDPParam&) = delete;

  const at::Tensor& param() const { return param_; }
  const std::string& fqn() const { return fqn_; }
  // Whether the parameter is a tensor-form DTensor (see above).
  bool is_dtensor() const { return compute_layout_.defined(); }
  // What the parameter holds between steps, as a layout of global_shape():
  // the shard over fully_shard's mesh (and, for a DTensor parameter, its own
  // placements over its mesh).
  const Layout& shard_layout() const { return shard_layout_; }
  // The parameter's global shape (full_shape() for a plain one).
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  // Whether the data is split across the shard group (false for replicated
  // parameters and for shard groups of one rank).
  bool sharded() const { return sharded_; }
  bool replicated() const { return replicated_; }
  bool requires_grad() const;
  // The unsharded (local, for a DTensor parameter) shape.
  const std::vector<int64_t>& full_shape() const { return full_shape_; }
  int64_t shard_dim() const { return shard_dim_; }
  int64_t shard_size() const { return shard_size_; }
  at::ScalarType orig_dtype() const { return orig_dtype_; }
  at::ScalarType compute_dtype() const { return compute_dtype_; }
  // The device the parameter computes and communicates on (where it was
  // when fully_shard took it; the mesh's for a meta parameter); the shard is
  // there too unless offloaded.
  c10::Device compute_device() const { return compute_device_; }
  bool offloaded() const { return offloaded_; }
  bool pinned() const { return pinned_; }
  // Options of a buffer on the compute device in `dtype`.
  at::TensorOptions compute_options(at::ScalarType dtype) const {
    return padded_shard_.options().device(compute_device_).dtype(dtype);
  }
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }
  // Whether forward needs an unsharded buffer: sharded, cast for compute,
  // or a DTensor (whose compute layout differs from its shard layout; kept
  // whole in its own dtype, the buffer is the shard itself).
  bool needs_unshard() const {
    return sharded_ || compute_dtype_ != orig_dtype_ || is_dtensor();
  }

  // What the parameter holds between steps.
  const at::Tensor& local_shard() const { return shard_view_; }
  // The padded shard (local_shard() is a view of it).
  const at::Tensor& padded_shard() const { return padded_shard_; }
  // Moves the padded shard into `view` (same shape and dtype), e.g. a slice
  // of a unit's flat buffer, and points the parameter at it if sharded now.
  void rebase_shard(const at::Tensor& view);

  // --- deferred initialisation (materialize.h) ---
  // Whether the shard is still on the meta device (fully_shard over a meta
  // parameter allocates nothing).
  bool on_meta() const { return padded_shard_.is_meta(); }
  // Where the shard lives once materialised: the host when offloaded, else
  // the compute device.
  c10::Device shard_device() const {
    return offloaded_ ? c10::Device(c10::DeviceType::CPU) : compute_device_;
  }
  // Gives a meta shard memory (uninitialised, the padding zeroed): `into`
  // when defined (a zeroed view of a unit's flat shard buffer, of the padded
  // shard's shape), else its own. A plain parameter's meta TensorImpl cannot
  // point at real memory, so `new_param` replaces it (the caller
  // re-registers the module's parameter); a DTensor parameter is re-pointed
  // in place. Nothing happens when the shard is not on meta.
  void materialize(const at::Tensor& into, const at::Tensor& new_param);

  // --- the unsharded buffer ---
  // Its shape: [shard_size * chunk, ...] (padded) for dim-0 shards, else the
  // full shape; compute dtype.
  std::vector<int64_t> unsharded_shape() const;
  int64_t unsharded_numel() const;
  // Makes the buffer's memory exist: a buffer of its own is created or
  // refilled; an external one (set_external_unsharded) is the group's job.
  at::Tensor& ensure_unsharded();
  // Uses `view` (of a unit's flat buffer) as the unsharded buffer; its
  // memory is then allocated and released by the owner of the flat buffer.
  void set_external_unsharded(at::Tensor view);

  // This rank's contribution to a gather over the shard group: the padded
  // shard in the compute dtype (a cast copy when the dtypes differ, else
  // the shard itself unless `snapshot` asks for a copy).
  // An offloaded shard is copied to the device: blocking, or with
  // `non_blocking` (the stream path, on the copy-in stream) asynchronously
  // from pinned memory; the end of backward waits for it once
  // (CommContext::finish_offload_copies) before the optimizer may write it.
  at::Tensor shard_gather_input(bool snapshot = false, bool non_blocking = false) const;
  // Gathers from `input` over `group` into the unsharded buffer (one
  // collective for this parameter); dims other than 0 gather into a buffer
  // of their own, copied out by finish_gather() once the gather was waited.
  dist::Work gather(dist::Group& group, const at::Tensor& input);
  void finish_gather();
  // Copies gathered pieces [G, n] (row g: group rank g's piece) into the
  // unsharded buffer.
  void copy_out(const at::Tensor& pieces);
  // Where group rank `index` of a gather over `pieces` ranks lands in the
  // unsharded buffer (a view, strided for dims other than 0), shaped like
  // that rank's input.
  at::Tensor unsharded_piece(int64_t pieces, int64_t index) const;
  // Unsharded but cast for compute: fills the buffer from the parameter's data.
  void cast_into_unsharded();

  enum class Data { kSharded, kUnsharded, kFreed };
  Data data() const { return data_; }
  // Points the parameter at the unsharded buffer. The first call creates the
  // gradient accumulator while the parameter has its compute shape and dtype
  // (so it accepts such gradients) and installs the post-accumulate hook;
  // later calls re-install it when a dtype change made autograd drop it.
  void use_unsharded();
  // Releases the unsharded memory but keeps the parameter's compute shape.
  void free_unsharded();
  // The parameter holds its shard again; the unsharded memory is released.
  void reshard();
  // As reshard(), but a buffer of its own keeps its memory and is returned
  // (else undefined): a gradient reduce-scatter receives into it instead of
  // allocating as much again. The caller releases it once that is done.
  at::Tensor reshard_lending_buffer();

  // --- a gathered copy kept across the end of backward ---
  // (reshard_after_backward = false) The parameter holds its shard again,
  // so the optimizer can step it, but the unsharded buffer keeps its memory
  // and values, stamped with the shard's version. reshard() leaves a kept
  // copy alone (the parameter already holds its shard); release_kept()
  // frees it.
  void reshard_keeping_unsharded();
  bool holds_kept_copy() const { return kept_; }
  // Whether the kept copy still equals a gather of the shard: neither the
  // parameter (an optimizer step) nor the shard buffer (a load, a write
  // through local_shard()) was written since. Writes through a tensor with
  // a version counter of its own (param.data(), a detached alias) are not
  // seen.
  bool kept_copy_is_current() const;
  // Points the parameter at the kept copy (use_unsharded()); it is not kept
  // any more. Requires kept_copy_is_current().
  void use_kept_copy();
  // Frees a kept copy's memory (a buffer of its own; a unit's flat buffer is
  // its owner's to release). The buffer is then refilled by a gather.
  void release_kept();

  // reshard_after_forward = N: keeps piece `index` of `pieces` (a copy of the
  // unsharded buffer's slice) for a later gather within a group of N ranks.
  void keep_regather_piece(int64_t pieces, int64_t index);
  const at::Tensor& regather_piece() const { return regather_piece_; }
  void drop_regather_piece() { regather_piece_ = at::Tensor(); }

  // Called after autograd accumulated a gradient into the parameter.
  void set_post_accumulate_hook(std::function<void()> hook);

  // --- gradients ---
  // Before backward: moves a shard-shaped .grad (from earlier steps) aside,
  // so autograd accumulates a fresh compute-shaped gradient.
  void stash_grad();
  // After accumulation: the full gradient (in the reduce dtype) plus
  // anything kept by keep_for_later(); .grad is cleared.
  at::Tensor take_grad();
  // No-sync accumulation: adds a full gradient (reduce dtype) to the kept one.
  void keep_for_later(at::Tensor full_grad);
  bool has_kept_grad() const { return kept_grad_.defined(); }
  // A pipeline step (RootContext::begin_pipeline_step) whose micro-batches
  // keep their gradients in the reduce dtype: what was kept before it is
  // remembered (keep_for_later adds out of place, so the tensor stays as it
  // was), so that a cancelled step drops only its own.
  void remember_kept_grad() { kept_before_step_ = kept_grad_; }
  void forget_remembered_kept_grad() { kept_before_step_ = at::Tensor(); }
  void restore_remembered_kept_grad() { kept_grad_ = std::move(kept_before_step_); }
  // .grad = the reduced shard, cast to the original dtype (+ the stash);
  // with apply_grad_on_fp32_main_grad the reduced shard is added to the main
  // grad as it is (reduce dtype) and .grad keeps only the stash.
  // Offloaded: the gradient goes to host memory (pinned when the policy
  // pins); with `non_blocking` the copy is queued on the current stream when
  // nothing on the host reads it before the caller's host wait (no stash,
  // no main grad), and assign_grad returns whether it was.
  bool assign_grad(at::Tensor reduced, bool non_blocking = false);
  // apply_grad_on_fp32_main_grad: the accumulated reduced gradient shard
  // (undefined before the first reduction and after zero_grad).
  const at::Tensor& main_grad() const { return main_grad_; }
  // .grad = the stashed gradient (when no new gradient arrived).
  void restore_stash();
  // Drops .grad, the main grad and everything kept or stashed.
  void zero_grad();
  // HSDP without all-reduce: reduce-scattered gradients accumulate here.
  at::Tensor& partial_reduce() { return partial_reduce_; }

  // --- one backward's gradient for its caller (grad_capture.h) ---
  // What the parameter has accumulated from earlier backwards: .grad, the
  // main grad, the no-sync and the partially reduced (HSDP) gradients.
  struct HeldGrads {
    at::Tensor grad, main_grad, kept, partial;
  };
  // Moves them out, leaving the parameter with none, so that what it holds
  // after the next backward is that backward's gradient alone.
  HeldGrads take_held_grads();
  // Puts them back, replacing whatever the parameter holds.
  void restore_held_grads(HeldGrads held);
  // The reduced gradient shard a backward left, taken out of the parameter:
  // .grad, or with apply_grad_on_fp32_main_grad the main grad (reduce
  // dtype), in the parameter's layout; undefined if none arrived.
  at::Tensor take_delivered_grad();
  // The gradient accumulator whose post-hook reduces (null until the
  // parameter first took its compute form, or when nothing communicates).
  torch::autograd::Node* grad_accumulator() const { return accumulator_.get(); }

  // The shard-sized piece of a reduce-scatter (padded shard numel).
  int64_t reduce_numel() const { return padded_shard_.numel(); }
  // Writes `full_grad` as [shard_size, reduce_numel()] rows (row r is what
  // rank r keeps, zero-padded) into `dst`, a [shard_size, reduce_numel()]
  // view (possibly a column block of a unit's buffer).
  void pack_for_reduce_scatter(const at::Tensor& full_grad, const at::Tensor& dst) const;
  // The gradient shard (torch.chunk piece) from a reduced [reduce_numel()]
  // slice.
  at::Tensor unpack_reduced(const at::Tensor& reduced) const;

 private:
  at::Tensor unsharded_view() const;
  std::pair<int64_t, int64_t> shard_versions() const;
  // Points the parameter at `local`: as it is, or wrapped in the compute
  // layout (`shard` false) or the shard layout for a DTensor parameter.
  void point_at(const at::Tensor& local, bool shard);
  // A gradient of the parameter as a local tensor; `shard` says which
  // layout it has (a compute-shaped gradient in another layout is
  // redistributed to the compute layout first).
  at::Tensor local_grad(const at::Tensor& grad, bool shard) const;
  // A local shard-shaped gradient as the parameter's .grad.
  at::Tensor as_param_grad(at::Tensor local) const;

  // The registered parameter (replaced only when a meta one materialises).
  at::Tensor param_;

  // Fixed when fully_shard takes the parameter (in initialisation order).
  const std::string fqn_;
  const std::vector<int64_t> global_shape_;
  const Layout compute_layout_;  // defined iff the parameter is a DTensor
  const std::vector<int64_t> full_shape_;
  const int64_t shard_dim_;
  const int64_t shard_size_;
  const bool replicated_;
  const bool sharded_;
  const Layout shard_layout_;
  const bool to_main_grad_;  // MixedPrecisionPolicy::apply_grad_on_fp32_main_grad
  const at::ScalarType orig_dtype_;
  const at::ScalarType compute_dtype_;
  const at::ScalarType reduce_dtype_;
  const c10::Device compute_device_;
  const bool offloaded_;
  const bool pinned_;

  // The lifecycle: where the data is and which buffers hold it.
  Data data_ = Data::kSharded;
  at::Tensor padded_shard_;     // original dtype; [chunk, ...] for dim 0
  at::Tensor shard_view_;       // the torch.chunk piece, a view of padded_shard_
  at::Tensor unsharded_;        // compute dtype
  bool owns_unsharded_ = true;  // false: a view of a unit's flat buffer
  at::Tensor gather_buffer_;    // dims other than 0: flat gather before the copy-out
  int64_t gather_pieces_ = 0;   // the ranks gather_buffer_ holds pieces of
  at::Tensor regather_piece_;   // reshard_after_forward = N
  bool kept_ = false;           // reshard_keeping_unsharded()
  // The parameter's and the shard buffer's versions when the copy was kept.
  std::pair<int64_t, int64_t> kept_versions_{0, 0};

  compat::AutogradNodePtr<> accumulator_;
  // Shared with the accumulator's post-hook, which holds it weakly: an
  // autograd graph may outlive this parameter's unit.
  std::shared_ptr<std::function<void()>> post_accumulate_hook_;
  at::Tensor stashed_grad_;
  at::Tensor kept_grad_;
  at::Tensor kept_before_step_;
  at::Tensor partial_reduce_;
  at::Tensor main_grad_;
};

}  // namespace hp::fsdp
