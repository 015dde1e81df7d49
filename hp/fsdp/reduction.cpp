#include "hp/fsdp/reduction.h"

#include <ATen/ATen.h>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/storage.h"

#include <algorithm>

namespace hp::fsdp {
namespace {

// A tensor over `view`'s memory that autograd does not consider a view:
// optimizers detach_() gradients in place, which views refuse.
at::Tensor alias_of(const at::Tensor& view) {
  at::Tensor alias = at::empty({0}, view.options());
  alias.set_(view.storage(), view.storage_offset(), view.sizes(), view.strides());
  return alias;
}

}  // namespace

PackedGrads::PackedGrads(std::vector<FSDPParam*> params) : params_(std::move(params)) {
  sharded_ = params_[0]->sharded();
  for (FSDPParam* p : params_) {
    offsets_.push_back(total_);
    total_ += sharded_ ? p->reduce_numel() : p->unsharded_numel();
  }
  arrived_.assign(params_.size(), false);
}

PackedGrads PackedGrads::of(FSDPParam& param, at::Tensor full_grad) {
  PackedGrads packed({&param});
  packed.arrived_[0] = true;
  const int64_t ranks = param.shard_size();
  if (!packed.sharded_) {
    packed.data_ = full_grad.contiguous().view(-1);
  } else if (param.shard_dim() == 0 && full_grad.size(0) == ranks * param.padded_shard().size(0)) {
    packed.data_ = full_grad.contiguous().view({ranks, packed.total_});
  } else {
    packed.allocate();
    param.pack_for_reduce_scatter(full_grad, packed.data_);
  }
  return packed;
}

void PackedGrads::allocate() {
  const FSDPParam& first = *params_[0];
  auto options = first.compute_options(first.reduce_dtype());
  // add() writes a parameter's whole block, padding included, except for
  // shards along another dim than 0; the blocks of parameters that get no
  // gradient are zeroed before the collective (zero_missing). So the buffer
  // is zeroed up front only in that case: a memset of a unit's gradients
  // per step saved.
  const bool blocks_written_whole =
      !sharded_ || std::all_of(params_.begin(), params_.end(),
                               [](const FSDPParam* p) { return p->shard_dim() == 0; });
  const std::vector<int64_t> shape =
      sharded_ ? std::vector<int64_t>{first.shard_size(), total_} : std::vector<int64_t>{total_};
  data_ = blocks_written_whole ? at::empty(shape, options) : at::zeros(shape, options);
  zeroed_ = !blocks_written_whole;
}

void PackedGrads::zero_missing() {
  if (zeroed_) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (arrived_[i]) continue;
    if (sharded_) {
      data_.narrow(1, offsets_[i], params_[i]->reduce_numel()).zero_();
    } else {
      data_.narrow(0, offsets_[i], params_[i]->unsharded_numel()).zero_();
    }
  }
  zeroed_ = true;
}

void PackedGrads::add(FSDPParam& param, const at::Tensor& full_grad) {
  if (!data_.defined()) allocate();
  const size_t i = std::find(params_.begin(), params_.end(), &param) - params_.begin();
  arrived_[i] = true;
  if (sharded_) {
    param.pack_for_reduce_scatter(full_grad, data_.narrow(1, offsets_[i], param.reduce_numel()));
  } else {
    data_.narrow(0, offsets_[i], full_grad.numel()).copy_(full_grad.reshape(-1));
  }
}

GradReduction::GradReduction(PackedGrads grads, at::Tensor scratch, const MeshInfo& mesh,
                             ReduceSettings settings, int64_t wave,
                             std::shared_ptr<void> keep_alive)
    : mesh_(mesh), settings_(settings), wave_(wave), keep_alive_(std::move(keep_alive)) {
  // Every block is set before the collective (so before `grads` gives up
  // its parameters): the buffer allocated if no gradient arrived, and the
  // blocks of the parameters without one zeroed.
  if (!grads.data_.defined()) grads.allocate();
  grads.zero_missing();
  params_ = std::move(grads.params_);
  offsets_ = std::move(grads.offsets_);
  arrived_ = std::move(grads.arrived_);
  if (grads.sharded_) {
    // The input is held by the collective only, so it is released the moment
    // the reduce-scatter completes (on the backend's thread), not when this
    // reduction is next advanced.
    at::Tensor input = std::move(grads.data_);
    output_ = at::empty({grads.total_}, input.options());
    const bool lend = scratch.defined() && scratch.scalar_type() == input.scalar_type() &&
                      scratch.numel() >= input.numel();
    work_ = dist::reduce_scatter(*mesh_.reduce_group, output_, input.view(-1),
                                 dist::ReduceOp::kSum, lend ? scratch.view(-1) : at::Tensor());
    if (lend) {
      work_.then([scratch] { free_storage(scratch); });
    } else if (scratch.defined()) {
      free_storage(scratch);  // unusable as the receive buffer: no reason to hold it
    }
    stage_ = Stage::kReduceScatter;
    return;
  }
  if (scratch.defined()) free_storage(scratch);
  output_ = std::move(grads.data_);
  if (settings_.over_mesh) {
    if (mesh_.size() == 1) {
      assign();
      return;
    }
    work_ = dist::all_reduce(*mesh_.mesh_group, output_, dist::ReduceOp::kSum);
    stage_ = Stage::kMeshAllReduce;
    return;
  }
  if (params_[0]->replicated() && mesh_.shard_size > 1) {
    // Replicated parameters differ per shard rank's data: reduce over them too.
    work_ = dist::all_reduce(*mesh_.reduce_group, output_, dist::ReduceOp::kSum);
    stage_ = Stage::kShardAllReduce;
    return;
  }
  start_replica_stage();
}

void GradReduction::start_replica_stage() {
  if (!mesh_.has_replicas()) {
    assign();
    return;
  }
  if (!settings_.all_reduce) {
    // Accumulate locally; a later backward with all-reduce adds it in.
    for (size_t i = 0; i < params_.size(); ++i) {
      FSDPParam& p = *params_[i];
      if (!arrived_[i]) continue;
      at::Tensor slice = output_.narrow(0, offsets_[i], p.sharded() ? p.reduce_numel()
                                                                     : p.unsharded_numel());
      at::Tensor& partial = p.partial_reduce();
      partial = partial.defined() ? partial + slice : slice.clone();
      p.reshard();
      p.restore_stash();
    }
    output_ = at::Tensor();
    stage_ = Stage::kDone;
    return;
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = *params_[i];
    at::Tensor& partial = p.partial_reduce();
    if (!partial.defined()) continue;
    output_.narrow(0, offsets_[i], partial.numel()).add_(partial);
    partial = at::Tensor();
  }
  // One all-reduce for everything this reduction carries: the replicate bucket.
  work_ = dist::all_reduce(*mesh_.replicate_group, output_, dist::ReduceOp::kSum);
  stage_ = Stage::kReplicaAllReduce;
}

bool GradReduction::advance() {
  switch (stage_) {
    case Stage::kReduceScatter:
    case Stage::kShardAllReduce:
      work_.wait();
      if (settings_.average && mesh_.shard_size > 1) output_.div_(mesh_.shard_size);
      start_replica_stage();
      break;
    case Stage::kReplicaAllReduce:
      work_.wait();
      if (settings_.average) output_.div_(mesh_.replicate_size);
      assign();
      break;
    case Stage::kMeshAllReduce:
      work_.wait();
      if (settings_.average) output_.div_(mesh_.size());
      assign();
      break;
    case Stage::kDone:
      break;
  }
  return stage_ == Stage::kDone;
}

void GradReduction::complete() {
  while (!advance()) {
  }
}

bool GradReduction::abandon() noexcept {
  bool waited = true;
  try {
    if (stage_ != Stage::kDone) work_.wait();
  } catch (...) {
    waited = false;
  }
  output_ = at::Tensor();
  stage_ = Stage::kDone;
  keep_alive_.reset();
  return waited;
}

void GradReduction::assign() {
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = *params_[i];
    // The optimizer steps the shard: the parameter must hold it.
    p.reshard();
    if (!arrived_[i]) {
      p.restore_stash();
      continue;
    }
    at::Tensor grad =
        p.sharded() ? p.unpack_reduced(output_.narrow(0, offsets_[i], p.reduce_numel()))
                    : output_.narrow(0, offsets_[i], p.unsharded_numel()).view(p.full_shape());
    p.assign_grad(alias_of(grad));
  }
  output_ = at::Tensor();
  stage_ = Stage::kDone;
  keep_alive_.reset();
}

bool GradReduction::covers(const FSDPParam& param) const {
  for (FSDPParam* p : params_) {
    if (p == &param) return true;
  }
  return false;
}

void ReductionQueue::push(std::unique_ptr<GradReduction> reduction) {
  if (!reduction->done()) pending_.push_back(std::move(reduction));
}

void ReductionQueue::complete_before(int64_t wave) {
  for (auto& r : pending_) {
    if (r->wave() < wave) r->complete();
  }
  drop_done();
}

void ReductionQueue::advance_before(int64_t wave) {
  for (auto& r : pending_) {
    if (r->wave() < wave) r->advance();
  }
  drop_done();
}

void ReductionQueue::complete_all() {
  for (auto& r : pending_) r->complete();
  pending_.clear();
}

bool ReductionQueue::abandon_all() noexcept {
  bool waited = true;
  for (auto& r : pending_) waited = r->abandon() && waited;
  pending_.clear();
  return waited;
}

bool ReductionQueue::pending_for(const FSDPParam& param) const {
  for (const auto& r : pending_) {
    if (r->covers(param)) return true;
  }
  return false;
}

void ReductionQueue::drop_done() {
  // Keeps the order of the rest.
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = (*it)->done() ? pending_.erase(it) : std::next(it);
  }
}

}  // namespace hp::fsdp
