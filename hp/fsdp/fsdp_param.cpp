#include "hp/fsdp/fsdp_param.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/dtensor_param.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/error.h"

#include <utility>

namespace hp::fsdp {
namespace {

// Runs a callback after the accumulator it is attached to has run.
class PostAccumulateHook : public torch::autograd::FunctionPostHook {
 public:
  explicit PostAccumulateHook(std::weak_ptr<std::function<void()>> hook) : hook_(std::move(hook)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    // A graph built while the unit lived may run after it is gone: then
    // there is nothing left to reduce into.
    if (auto hook = hook_.lock(); hook && *hook) (*hook)();
    return outputs;
  }

 private:
  std::weak_ptr<std::function<void()>> hook_;
};

// The tensor a parameter's data lives in: a DTensor's local tensor, else
// the parameter itself (detached).
at::Tensor local_data(const at::Tensor& param) {
  return hp::is_dtensor(param) ? local_of(param) : param.detach();
}

size_t nbytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

at::ScalarType FSDPParam::compute_dtype_for(at::ScalarType orig, const MixedPrecisionPolicy& mp) {
  return mp.param_dtype.value_or(orig);
}

at::ScalarType FSDPParam::reduce_dtype_for(at::ScalarType orig, const MixedPrecisionPolicy& mp) {
  return mp.reduce_dtype.value_or(compute_dtype_for(orig, mp));
}

FSDPParam::FSDPParam(at::Tensor param, std::string fqn, const MeshInfo& mesh, int64_t shard_dim,
                     bool replicated, const MixedPrecisionPolicy& mp,
                     const OffloadPolicy& offload)
    : param_(std::move(param)),
      fqn_(std::move(fqn)),
      global_shape_(param_.sizes().vec()),
      compute_layout_(hp::is_dtensor(param_) ? layout_of(param_).normalized(param_.dim())
                                             : Layout()),
      full_shape_(local_data(param_).sizes().vec()),
      shard_dim_(shard_dim),
      shard_size_(mesh.shard_size),
      replicated_(replicated),
      sharded_(!replicated && mesh.shard_size > 1),
      shard_layout_(fsdp::shard_layout(mesh, is_dtensor() ? &compute_layout_ : nullptr,
                                       param_.dim(),
                                       sharded_ ? std::optional<int64_t>(shard_dim_)
                                                : std::nullopt)),
      to_main_grad_(mp.apply_grad_on_fp32_main_grad),
      orig_dtype_(param_.scalar_type()),
      compute_dtype_(compute_dtype_for(orig_dtype_, mp)),
      reduce_dtype_(reduce_dtype_for(orig_dtype_, mp)),
      // A meta parameter (deferred initialisation, materialize.h) will live
      // on the mesh's device; until materialize() its shard is meta too.
      compute_device_(local_data(param_).is_meta() ? mesh.mesh->device()
                                                   : local_data(param_).device()),
      // Only a sharded parameter moves to the host; one kept whole stays put.
      offloaded_(sharded_ && offload.kind == OffloadPolicy::Kind::kCPU &&
                 !compute_device_.is_cpu()),
      pinned_(offloaded_ && offload.pin_memory) {
  at::Tensor data = local_data(param_);
  // Any existing gradient is sharded the same way.
  at::Tensor grad = param_.grad().defined() ? local_grad(param_.grad(), false) : at::Tensor();
  if (!sharded_) {
    padded_shard_ = data;
    shard_view_ = data;
    if (is_dtensor()) {
      // Kept whole: compute needs only the other layout, not a copy.
      if (compute_dtype_ == orig_dtype_) {
        unsharded_ = data;
        owns_unsharded_ = false;
      }
      point_at(shard_view_, /*shard=*/true);
      if (grad.defined()) param_.mutable_grad() = as_param_grad(grad);
    }
    return;
  }
  const int64_t length = full_shape_[shard_dim_];
  Span mine = chunk_span(length, shard_size_, mesh.shard_rank);
  if (shard_dim_ == 0) {
    const int64_t chunk = chunk_span(length, shard_size_, 0).size;
    std::vector<int64_t> shape = full_shape_;
    shape[0] = chunk;
    padded_shard_ = at::zeros(shape, data.options());
    padded_shard_.narrow(0, 0, mine.size).copy_(data.narrow(0, mine.offset, mine.size));
    shard_view_ = padded_shard_.narrow(0, 0, mine.size);
  } else {
    padded_shard_ = data.narrow(shard_dim_, mine.offset, mine.size).clone(at::MemoryFormat::Contiguous);
    shard_view_ = padded_shard_;
  }
  if (offloaded_ && !data.is_meta()) {
    at::Tensor host = at::empty(padded_shard_.sizes(),
                                padded_shard_.options().device(at::kCPU).pinned_memory(pinned_));
    host.copy_(padded_shard_);
    padded_shard_ = host;
    shard_view_ = shard_dim_ == 0 ? host.narrow(0, 0, mine.size) : host;
  }
  at::Tensor grad_shard;
  if (grad.defined()) {
    grad_shard = grad.narrow(shard_dim_, mine.offset, mine.size).to(padded_shard_.device(),
                                                                      /*non_blocking=*/false,
                                                                      /*copy=*/true);
  }
  point_at(shard_view_, /*shard=*/true);
  param_.mutable_grad() = grad_shard.defined() ? as_param_grad(grad_shard) : at::Tensor();
}

void FSDPParam::materialize(const at::Tensor& into, const at::Tensor& new_param) {
  if (!on_meta()) return;
  HP_CHECK_ARG(!into.defined() || (into.sizes() == padded_shard_.sizes() &&
                                   into.scalar_type() == orig_dtype_ && !into.is_meta()),
               "internal error: materialising ", fqn_, " into an incompatible buffer");
  at::Tensor fresh = into;
  if (!fresh.defined()) {
    // Zeroed: the padding of an uneven dim-0 shard is gathered as it is.
    fresh = at::empty(padded_shard_.sizes(), padded_shard_.options()
                                                 .device(shard_device())
                                                 .pinned_memory(pinned_));
    fresh.zero_();
  }
  const bool padded = sharded_ && shard_dim_ == 0;
  const int64_t mine = padded ? shard_view_.size(0) : 0;
  padded_shard_ = fresh;
  shard_view_ = padded ? fresh.narrow(0, 0, mine) : fresh;
  if (!sharded_ && !owns_unsharded_) unsharded_ = fresh;  // a DTensor kept whole
  if (new_param.defined()) param_ = new_param;
  point_at(shard_view_, /*shard=*/true);
  data_ = Data::kSharded;
}

void FSDPParam::point_at(const at::Tensor& local, bool shard) {
  if (!is_dtensor()) {
    param_.set_data(local);
    return;
  }
  param_.set_data(wrap_local_shard(local, shard ? shard_layout_ : compute_layout_,
                                   global_shape_));
}

at::Tensor FSDPParam::local_grad(const at::Tensor& grad, bool shard) const {
  if (!hp::is_dtensor(grad)) return grad;
  const Layout& expected = shard ? shard_layout_ : compute_layout_;
  if (!shard && layout_of(grad).normalized(grad.dim()) != expected) {
    // A rule may leave a gradient in another layout than its parameter's
    // (e.g. Partial); every rank of the parameter's mesh runs the same
    // backward, so every one of them redistributes here.
    return local_of(hp::redistribute(grad, expected));
  }
  HP_CHECK_ARG(layout_of(grad).normalized(grad.dim()) == expected, "gradient of '", fqn_,
               "' has layout ", layout_of(grad).str(), ", expected ", expected.str());
  return local_of(grad);
}

at::Tensor FSDPParam::as_param_grad(at::Tensor local) const {
  if (!is_dtensor() || !local.defined()) return local;
  return wrap_local_shard(local, shard_layout_, global_shape_);
}

bool FSDPParam::requires_grad() const { return param_.requires_grad(); }

void FSDPParam::rebase_shard(const at::Tensor& view) {
  HP_CHECK_ARG(view.sizes() == padded_shard_.sizes() && view.scalar_type() == orig_dtype_,
               "internal error: rebasing ", fqn_, " onto an incompatible buffer");
  view.copy_(padded_shard_);
  const bool holds_shard = data_ == Data::kSharded;
  padded_shard_ = view;
  shard_view_ = shard_dim_ == 0 ? view.narrow(0, 0, shard_view_.size(0)) : view;
  if (!sharded_) unsharded_ = owns_unsharded_ ? at::Tensor() : view;
  if (holds_shard) point_at(shard_view_, /*shard=*/true);
}

std::vector<int64_t> FSDPParam::unsharded_shape() const {
  if (sharded_ && shard_dim_ == 0) {
    std::vector<int64_t> shape = padded_shard_.sizes().vec();
    shape[0] *= shard_size_;
    return shape;
  }
  return full_shape_;
}

int64_t FSDPParam::unsharded_numel() const {
  int64_t n = 1;
  for (int64_t s : unsharded_shape()) n *= s;
  return n;
}

at::Tensor& FSDPParam::ensure_unsharded() {
  if (!unsharded_.defined()) {
    unsharded_ = at::empty(unsharded_shape(), compute_options(compute_dtype_));
  } else if (owns_unsharded_) {
    allocate_storage(unsharded_, nbytes_of(unsharded_));
  }
  return unsharded_;
}

void FSDPParam::set_external_unsharded(at::Tensor view) {
  unsharded_ = view.view(unsharded_shape());
  owns_unsharded_ = false;
}

at::Tensor FSDPParam::shard_gather_input(bool snapshot, bool non_blocking) const {
  // An offloaded shard goes to the device for the collective. Blocking on
  // the host path: the optimizer may update the host shard as soon as
  // backward returns, which must not race a copy still queued behind
  // compute. The stream path copies asynchronously from pinned memory and
  // waits once at the end of backward instead.
  if (offloaded_) {
    return padded_shard_.to(compute_device_, compute_dtype_, non_blocking && pinned_, true);
  }
  if (compute_dtype_ != orig_dtype_) return padded_shard_.to(compute_dtype_);
  return snapshot ? padded_shard_.clone() : padded_shard_;
}

dist::Work FSDPParam::gather(dist::Group& group, const at::Tensor& input) {
  ensure_unsharded();
  if (shard_dim_ == 0) return dist::all_gather_into(group, unsharded_, input);
  gather_buffer_ = at::empty({group.size() * input.numel()}, input.options());
  gather_pieces_ = group.size();
  return dist::all_gather_into(group, gather_buffer_, input);
}

void FSDPParam::finish_gather() {
  if (!gather_buffer_.defined()) return;
  copy_out(gather_buffer_.view({gather_pieces_, -1}));
  gather_buffer_ = at::Tensor();
}

void FSDPParam::copy_out(const at::Tensor& pieces) {
  const int64_t count = pieces.size(0);
  if (shard_dim_ == 0) {
    unsharded_.view({count, -1}).copy_(pieces);
    return;
  }
  std::vector<int64_t> piece_shape = full_shape_;
  piece_shape[shard_dim_] /= count;
  std::vector<at::Tensor> parts;
  for (int64_t g = 0; g < count; ++g) parts.push_back(pieces[g].view(piece_shape));
  at::cat_out(unsharded_, parts, shard_dim_);
}

at::Tensor FSDPParam::unsharded_piece(int64_t pieces, int64_t index) const {
  if (shard_dim_ != 0) return unsharded_.chunk(pieces, shard_dim_)[index];
  std::vector<int64_t> shape = unsharded_.sizes().vec();
  shape[0] /= pieces;
  return unsharded_.view({pieces, -1})[index].view(shape);
}

void FSDPParam::cast_into_unsharded() {
  // A DTensor kept whole in its own dtype computes on the shard itself.
  if (!sharded_ && !owns_unsharded_) return;
  ensure_unsharded().copy_(padded_shard_);
}

at::Tensor FSDPParam::unsharded_view() const {
  if (sharded_ && shard_dim_ == 0) return unsharded_.narrow(0, 0, full_shape_[0]);
  return unsharded_;
}

void FSDPParam::use_unsharded() {
  if (!needs_unshard()) return;
  point_at(unsharded_view(), /*shard=*/false);
  data_ = Data::kUnsharded;
  if (!param_.requires_grad()) return;
  if (!accumulator_) {
    accumulator_ = torch::autograd::impl::grad_accumulator(param_);
    accumulator_->add_post_hook(std::make_unique<PostAccumulateHook>(post_accumulate_hook_));
  } else if (compute_dtype_ != orig_dtype_) {
    // set_data with another dtype made autograd forget the accumulator.
    torch::autograd::impl::set_grad_accumulator(param_, compat::weak_autograd_node(accumulator_));
  }
}

void FSDPParam::free_unsharded() {
  if (!needs_unshard() || data_ != Data::kUnsharded) return;
  if (owns_unsharded_) free_storage(unsharded_);
  data_ = Data::kFreed;
}

void FSDPParam::reshard() {
  if (!needs_unshard() || data_ == Data::kSharded) return;
  point_at(shard_view_, /*shard=*/true);
  if (owns_unsharded_) free_storage(unsharded_);
  data_ = Data::kSharded;
}

at::Tensor FSDPParam::reshard_lending_buffer() {
  if (!needs_unshard() || data_ != Data::kUnsharded || !owns_unsharded_) {
    reshard();
    return at::Tensor();
  }
  point_at(shard_view_, /*shard=*/true);
  data_ = Data::kSharded;
  return unsharded_;
}

std::pair<int64_t, int64_t> FSDPParam::shard_versions() const {
  return {param_._version(), padded_shard_._version()};
}

void FSDPParam::reshard_keeping_unsharded() {
  if (!needs_unshard() || data_ != Data::kUnsharded) return;
  point_at(shard_view_, /*shard=*/true);
  data_ = Data::kSharded;
  kept_ = true;
  kept_versions_ = shard_versions();
}

bool FSDPParam::kept_copy_is_current() const { return kept_ && shard_versions() == kept_versions_; }

void FSDPParam::use_kept_copy() {
  HP_CHECK_ARG(kept_copy_is_current(), "internal error: ", fqn_, " has no current kept copy");
  kept_ = false;
  use_unsharded();
}

void FSDPParam::release_kept() {
  if (!kept_) return;
  kept_ = false;
  if (owns_unsharded_) free_storage(unsharded_);
}

void FSDPParam::keep_regather_piece(int64_t pieces, int64_t index) {
  if (shard_dim_ == 0) {
    regather_piece_ = unsharded_.view({pieces, -1})[index].clone();
  } else {
    regather_piece_ = unsharded_.chunk(pieces, shard_dim_)[index].clone(at::MemoryFormat::Contiguous);
  }
}

void FSDPParam::set_post_accumulate_hook(std::function<void()> hook) {
  post_accumulate_hook_ = std::make_shared<std::function<void()>>(std::move(hook));
  if (!needs_unshard() && !accumulator_ && param_.requires_grad()) {
    // Parameters that never change shape or dtype: attach right away.
    accumulator_ = torch::autograd::impl::grad_accumulator(param_);
    accumulator_->add_post_hook(std::make_unique<PostAccumulateHook>(post_accumulate_hook_));
  }
}

void FSDPParam::stash_grad() {
  at::Tensor& grad = param_.mutable_grad();
  if (!grad.defined()) return;
  at::Tensor local = local_grad(grad, /*shard=*/true);
  stashed_grad_ = stashed_grad_.defined() ? stashed_grad_ + local : local;
  grad = at::Tensor();
}

at::Tensor FSDPParam::take_grad() {
  at::Tensor grad = std::move(param_.mutable_grad());  // leaves .grad undefined
  if (grad.defined()) grad = local_grad(grad, /*shard=*/false);
  if (grad.defined() && grad.scalar_type() != reduce_dtype_) grad = grad.to(reduce_dtype_);
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

bool FSDPParam::assign_grad(at::Tensor reduced, bool non_blocking) {
  // Offloaded: the gradient joins the shard in host memory (pinned as the
  // policy says), where the optimizer steps. Blocking unless the caller
  // waits for the copies itself and nothing here reads the host copy first.
  bool queued = false;
  if (offloaded_ && reduced.device() != padded_shard_.device()) {
    const bool async = non_blocking && pinned_ && !to_main_grad_ && !stashed_grad_.defined();
    if (async && reduced.scalar_type() != orig_dtype_) reduced = reduced.to(orig_dtype_);
    at::Tensor host = at::empty(reduced.sizes(), reduced.options().device(at::kCPU).pinned_memory(pinned_));
    host.copy_(reduced, async);
    reduced = std::move(host);
    queued = async;
  }
  if (to_main_grad_) {
    // Kept in the reduce dtype; what autograd or the user left in .grad
    // before this backward (the stash) stays there.
    main_grad_ = main_grad_.defined() ? main_grad_.add_(reduced) : std::move(reduced);
    param_.mutable_grad() = as_param_grad(std::move(stashed_grad_));
    stashed_grad_ = at::Tensor();
    return queued;
  }
  if (reduced.scalar_type() != orig_dtype_) reduced = reduced.to(orig_dtype_);
  if (stashed_grad_.defined()) {
    reduced = reduced + stashed_grad_;
    stashed_grad_ = at::Tensor();
  }
  param_.mutable_grad() = as_param_grad(std::move(reduced));
  return queued;
}

void FSDPParam::restore_stash() {
  if (!stashed_grad_.defined()) return;
  at::Tensor& grad = param_.mutable_grad();
  // A gradient in another layout (compute-shaped) is replaced, as a plain
  // one of another shape is.
  at::Tensor local;
  if (grad.defined() && (!hp::is_dtensor(grad) ||
                         layout_of(grad).normalized(grad.dim()) == shard_layout_)) {
    local = hp::is_dtensor(grad) ? local_of(grad) : grad;
  }
  grad = as_param_grad(local.defined() && local.sizes() == stashed_grad_.sizes()
                           ? local + stashed_grad_.to(local.device())
                           : stashed_grad_);
  stashed_grad_ = at::Tensor();
}

void FSDPParam::zero_grad() {
  param_.mutable_grad() = at::Tensor();
  stashed_grad_ = at::Tensor();
  kept_grad_ = at::Tensor();
  partial_reduce_ = at::Tensor();
  main_grad_ = at::Tensor();
}

FSDPParam::HeldGrads FSDPParam::take_held_grads() {
  HeldGrads held{std::move(param_.mutable_grad()), std::move(main_grad_), std::move(kept_grad_),
                 std::move(partial_reduce_)};  // moved-from tensors are undefined
  return held;
}

void FSDPParam::restore_held_grads(HeldGrads held) {
  param_.mutable_grad() = std::move(held.grad);
  main_grad_ = std::move(held.main_grad);
  kept_grad_ = std::move(held.kept);
  partial_reduce_ = std::move(held.partial);
}

at::Tensor FSDPParam::take_delivered_grad() {
  if (to_main_grad_) return as_param_grad(std::exchange(main_grad_, at::Tensor()));
  return std::exchange(param_.mutable_grad(), at::Tensor());
}

void FSDPParam::pack_for_reduce_scatter(const at::Tensor& full_grad, const at::Tensor& dst) const {
  std::vector<int64_t> block = padded_shard_.sizes().vec();
  block.insert(block.begin(), shard_size_);
  at::Tensor rows = dst.view(block);  // [shard_size, *padded shard shape]
  if (shard_dim_ != 0) {
    auto pieces = full_grad.chunk(shard_size_, shard_dim_);
    for (int64_t r = 0; r < shard_size_; ++r) rows[r].copy_(pieces[r]);
    return;
  }
  const int64_t chunk = padded_shard_.size(0);
  const int64_t length = full_grad.size(0);
  for (int64_t r = 0; r < shard_size_; ++r) {
    const int64_t begin = std::min(length, r * chunk);
    const int64_t count = std::min(length, begin + chunk) - begin;
    if (count > 0) rows[r].narrow(0, 0, count).copy_(full_grad.narrow(0, begin, count));
    if (count < chunk) rows[r].narrow(0, count, chunk - count).zero_();
  }
}

at::Tensor FSDPParam::unpack_reduced(const at::Tensor& reduced) const {
  at::Tensor shard = reduced.view(padded_shard_.sizes());
  if (shard_dim_ == 0 && shard_view_.size(0) != padded_shard_.size(0)) {
    shard = shard.narrow(0, 0, shard_view_.size(0));
  }
  return shard;
}

}  // namespace hp::fsdp
