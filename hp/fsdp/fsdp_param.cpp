#include "hp/fsdp/fsdp_param.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "hp/dist/collectives.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/error.h"

namespace hp::fsdp {
namespace {

// Runs a callback after the accumulator it is attached to has run.
class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::function<void()>* hook) : hook_(hook) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (*hook_) (*hook_)();
    return outputs;
  }

 private:
  std::function<void()>* hook_;  // owned by the FSDPParam, which outlives the accumulator's use
};

size_t nbytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

FSDPParam::FSDPParam(at::Tensor param, std::string fqn, const MeshInfo& mesh, int64_t shard_dim,
                     bool replicated)
    : param_(std::move(param)),
      fqn_(std::move(fqn)),
      full_shape_(param_.sizes().vec()),
      shard_dim_(shard_dim),
      shard_size_(mesh.shard_size),
      shard_rank_(mesh.shard_rank),
      replicated_(replicated),
      sharded_(!replicated && mesh.shard_size > 1) {
  at::Tensor data = param_.detach();
  if (!sharded_) {
    padded_shard_ = data;
    shard_view_ = data;
    unsharded_ = data;
    return;
  }
  const int64_t length = full_shape_[shard_dim_];
  Span mine = chunk_span(length, shard_size_, shard_rank_);
  if (shard_dim_ == 0) {
    const int64_t chunk = chunk_span(length, shard_size_, 0).size;
    std::vector<int64_t> shape = full_shape_;
    shape[0] = chunk;
    padded_shard_ = at::zeros(shape, data.options());
    padded_shard_.narrow(0, 0, mine.size).copy_(data.narrow(0, mine.offset, mine.size));
    shard_view_ = padded_shard_.narrow(0, 0, mine.size);
  } else {
    padded_shard_ = data.narrow(shard_dim_, mine.offset, mine.size).contiguous().clone();
    shard_view_ = padded_shard_;
  }
  // Any existing gradient is sharded the same way.
  at::Tensor grad = param_.grad();
  at::Tensor grad_shard;
  if (grad.defined()) {
    grad_shard = grad.narrow(shard_dim_, mine.offset, mine.size).clone();
  }
  param_.set_data(shard_view_);
  param_.mutable_grad() = grad_shard;
}

bool FSDPParam::requires_grad() const { return param_.requires_grad(); }

dist::Work FSDPParam::all_gather(dist::Group& group) {
  HP_CHECK_ARG(sharded_, "internal error: all_gather of unsharded parameter ", fqn_);
  if (shard_dim_ == 0) {
    if (!unsharded_.defined()) {
      std::vector<int64_t> shape = padded_shard_.sizes().vec();
      shape[0] *= shard_size_;
      unsharded_ = at::empty(shape, padded_shard_.options());
    } else {
      allocate_storage(unsharded_, nbytes_of(unsharded_));
    }
    return dist::all_gather_into(group, unsharded_, padded_shard_);
  }
  if (!unsharded_.defined()) {
    unsharded_ = at::empty(full_shape_, padded_shard_.options());
  } else {
    allocate_storage(unsharded_, nbytes_of(unsharded_));
  }
  gather_buffer_ = at::empty({shard_size_ * padded_shard_.numel()}, padded_shard_.options());
  return dist::all_gather_into(group, gather_buffer_, padded_shard_);
}

void FSDPParam::use_unsharded() {
  if (!sharded_) return;
  if (shard_dim_ == 0) {
    param_.set_data(unsharded_.narrow(0, 0, full_shape_[0]));
  } else {
    std::vector<int64_t> pieces_shape = padded_shard_.sizes().vec();
    pieces_shape.insert(pieces_shape.begin(), shard_size_);
    auto pieces = gather_buffer_.view(pieces_shape).unbind(0);
    at::cat_out(unsharded_, pieces, shard_dim_);
    gather_buffer_ = at::Tensor();
    param_.set_data(unsharded_);
  }
  data_ = Data::kUnsharded;
  if (!accumulator_ && param_.requires_grad()) {
    accumulator_ = torch::autograd::impl::grad_accumulator(param_);
    accumulator_->add_post_hook(std::make_unique<PostAccumulateHook>(&post_accumulate_hook_));
  }
}

void FSDPParam::free_unsharded() {
  if (!sharded_ || data_ != Data::kUnsharded) return;
  free_storage(unsharded_);
  data_ = Data::kFreed;
}

void FSDPParam::reshard() {
  if (!sharded_ || data_ == Data::kSharded) return;
  param_.set_data(shard_view_);
  free_storage(unsharded_);
  data_ = Data::kSharded;
}

at::Tensor FSDPParam::reshard_lending_buffer() {
  if (!sharded_ || data_ != Data::kUnsharded) {
    reshard();
    return at::Tensor();
  }
  param_.set_data(shard_view_);
  data_ = Data::kSharded;
  return unsharded_;
}

void FSDPParam::set_post_accumulate_hook(std::function<void()> hook) {
  post_accumulate_hook_ = std::move(hook);
  if (!sharded_ && !accumulator_ && param_.requires_grad()) {
    // Unsharded parameters never change shape: attach right away.
    accumulator_ = torch::autograd::impl::grad_accumulator(param_);
    accumulator_->add_post_hook(std::make_unique<PostAccumulateHook>(&post_accumulate_hook_));
  }
}

void FSDPParam::stash_grad() {
  at::Tensor& grad = param_.mutable_grad();
  if (!grad.defined()) return;
  stashed_grad_ = stashed_grad_.defined() ? stashed_grad_ + grad : grad;
  grad = at::Tensor();
}

at::Tensor FSDPParam::take_grad() {
  at::Tensor grad = std::move(param_.mutable_grad());
  param_.mutable_grad() = at::Tensor();
  if (kept_grad_.defined()) {
    grad = grad.defined() ? grad + kept_grad_ : kept_grad_;
    kept_grad_ = at::Tensor();
  }
  return grad;
}

void FSDPParam::keep_for_later(at::Tensor full_grad) {
  if (!full_grad.defined()) return;
  kept_grad_ = kept_grad_.defined() ? kept_grad_ + full_grad : std::move(full_grad);
}

void FSDPParam::assign_grad(at::Tensor reduced) {
  if (stashed_grad_.defined()) {
    reduced = reduced + stashed_grad_;
    stashed_grad_ = at::Tensor();
  }
  param_.mutable_grad() = std::move(reduced);
}

void FSDPParam::restore_stash() {
  if (!stashed_grad_.defined()) return;
  at::Tensor& grad = param_.mutable_grad();
  grad = grad.defined() ? grad + stashed_grad_ : stashed_grad_;
  stashed_grad_ = at::Tensor();
}

void FSDPParam::zero_grad() {
  param_.mutable_grad() = at::Tensor();
  stashed_grad_ = at::Tensor();
  kept_grad_ = at::Tensor();
  partial_reduce_ = at::Tensor();
}

at::Tensor FSDPParam::pack_for_reduce_scatter(const at::Tensor& full_grad) const {
  const int64_t row = padded_shard_.numel();
  if (shard_dim_ == 0) {
    const int64_t padded_rows = padded_shard_.size(0) * shard_size_;
    if (full_grad.size(0) == padded_rows) return full_grad.contiguous().view({shard_size_, row});
    std::vector<int64_t> shape = full_grad.sizes().vec();
    shape[0] = padded_rows;
    at::Tensor packed = at::zeros(shape, full_grad.options());
    packed.narrow(0, 0, full_grad.size(0)).copy_(full_grad);
    return packed.view({shard_size_, row});
  }
  auto pieces = full_grad.chunk(shard_size_, shard_dim_);
  return at::stack(pieces).contiguous().view({shard_size_, row});
}

at::Tensor FSDPParam::unpack_reduced(const at::Tensor& output) const {
  if (shard_dim_ != 0 || shard_view_.size(0) == padded_shard_.size(0)) return output;
  return output.narrow(0, 0, shard_view_.size(0)).clone();
}

}  // namespace hp::fsdp
