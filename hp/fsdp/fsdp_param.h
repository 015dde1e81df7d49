// One parameter managed by fully_shard: its shard, its unsharded buffer and
// its gradient bookkeeping (FSDP_MECHANISM.md).
//
// The registered parameter's TensorImpl is never replaced, so the user's
// optimizer keeps working on it. Between steps it holds this rank's shard
// (the torch.chunk piece of dim 0, or of the dim shard_placement_fn chose)
// as a view into a zero-padded shard buffer, so every rank all-gathers the
// same number of elements. For compute it points at the unsharded buffer;
// after forward that buffer's memory can be released while the parameter
// keeps its full shape (autograd's saved views stay valid), and it is
// refilled into the same storage before backward.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/dist/work.h"
#include "hp/fsdp/mesh_info.h"

namespace torch::autograd {
struct Node;
}

namespace hp::fsdp {

class FSDPParam {
 public:
  // Shards `param` in place. `replicated` keeps it whole (replicate_params);
  // a shard group of one rank keeps it whole too.
  FSDPParam(at::Tensor param, std::string fqn, const MeshInfo& mesh, int64_t shard_dim,
            bool replicated);
  FSDPParam(const FSDPParam&) = delete;
  FSDPParam& operator=(const FSDPParam&) = delete;

  const at::Tensor& param() const { return param_; }
  const std::string& fqn() const { return fqn_; }
  // Whether the data is split across the shard group (false for replicated
  // parameters and for shard groups of one rank).
  bool sharded() const { return sharded_; }
  bool replicated() const { return replicated_; }
  bool requires_grad() const;
  const std::vector<int64_t>& full_shape() const { return full_shape_; }
  int64_t shard_dim() const { return shard_dim_; }
  // What the parameter holds between steps.
  const at::Tensor& local_shard() const { return shard_view_; }
  // The padded shard the all-gather reads (local_shard() is a view of it).
  const at::Tensor& padded_shard() const { return padded_shard_; }

  enum class Data { kSharded, kUnsharded, kFreed };
  Data data() const { return data_; }

  // Issues the all-gather of the shard into the unsharded buffer (allocating
  // its memory if it was released). Call use_unsharded() after waiting.
  dist::Work all_gather(dist::Group& group);
  // Points the parameter at the gathered data. The first call creates the
  // gradient accumulator while the parameter has its full shape, so that it
  // accepts full-shaped gradients, and installs the post-accumulate hook.
  void use_unsharded();
  // Releases the unsharded memory but keeps the parameter's full shape.
  void free_unsharded();
  // The parameter holds its shard again; the unsharded memory is released.
  void reshard();
  // As reshard(), but the unsharded buffer keeps its memory and is returned
  // (undefined if there is none): the gradient's reduce-scatter receives
  // into it instead of allocating as much again. The caller releases it
  // (free_storage) once the collective is done, before the next gather.
  at::Tensor reshard_lending_buffer();

  // Called after autograd accumulated a gradient into the parameter.
  void set_post_accumulate_hook(std::function<void()> hook);

  // --- gradients ---
  // Before backward: moves a shard-shaped .grad (from earlier steps) aside,
  // so autograd accumulates a fresh full-shaped gradient.
  void stash_grad();
  // After accumulation: the full gradient plus anything kept by
  // keep_for_later(); .grad is cleared.
  at::Tensor take_grad();
  // No-sync accumulation: adds a full gradient to the kept one.
  void keep_for_later(at::Tensor full_grad);
  bool has_kept_grad() const { return kept_grad_.defined(); }
  // .grad = reduced shard (+ the stashed gradient).
  void assign_grad(at::Tensor reduced);
  // .grad = the stashed gradient (when no new gradient arrived).
  void restore_stash();
  // Drops .grad and everything kept or stashed.
  void zero_grad();
  // HSDP without all-reduce: reduce-scattered gradients accumulate here.
  at::Tensor& partial_reduce() { return partial_reduce_; }

  // The unsharded gradient's layout for reduce-scatter: a [shard_size, n]
  // buffer whose row r is what rank r keeps (padded where uneven).
  at::Tensor pack_for_reduce_scatter(const at::Tensor& full_grad) const;
  // The gradient shard from a reduce-scatter output shaped like
  // padded_shard(): the output itself, or a copy without the padding (a
  // gradient must not be a view: optimizers detach_() gradients in place).
  at::Tensor unpack_reduced(const at::Tensor& output) const;
  int64_t padded_shard_numel() const { return padded_shard_.numel(); }

 private:
  at::Tensor param_;
  std::string fqn_;
  std::vector<int64_t> full_shape_;
  int64_t shard_dim_ = 0;
  int64_t shard_size_ = 1;
  int64_t shard_rank_ = 0;
  bool replicated_ = false;
  bool sharded_ = false;
  Data data_ = Data::kSharded;

  at::Tensor padded_shard_;  // [chunk, ...] (dim 0) or the even chunk (other dims)
  at::Tensor shard_view_;    // the torch.chunk piece, a view of padded_shard_
  at::Tensor unsharded_;     // the gathered buffer (padded along dim 0)
  at::Tensor gather_buffer_; // shard dims other than 0: flat gather before the copy-out

  std::shared_ptr<torch::autograd::Node> accumulator_;
  std::function<void()> post_accumulate_hook_;
  at::Tensor stashed_grad_;
  at::Tensor kept_grad_;
  at::Tensor partial_reduce_;
};

}  // namespace hp::fsdp
