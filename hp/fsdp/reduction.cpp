#include "hp/fsdp/reduction.h"

#include <ATen/ATen.h>

#include "hp/dist/collectives.h"
#include "hp/fsdp/storage.h"

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

GradReduction::GradReduction(std::vector<FSDPParam*> params, std::vector<at::Tensor> grads,
                             at::Tensor scratch, const MeshInfo& mesh, ReduceSettings settings,
                             int64_t wave, std::shared_ptr<void> keep_alive)
    : params_(std::move(params)),
      mesh_(mesh),
      settings_(settings),
      wave_(wave),
      keep_alive_(std::move(keep_alive)) {
  const bool sharded = params_[0]->sharded();
  int64_t total = 0;
  for (FSDPParam* p : params_) {
    offsets_.push_back(total);
    total += sharded ? p->reduce_numel() : p->unsharded_numel();
  }
  const at::TensorOptions options = grads[0].options();
  if (sharded) {
    const int64_t ranks = mesh_.shard_size;
    const FSDPParam& first = *params_[0];
    if (params_.size() == 1 && first.shard_dim() == 0 &&
        grads[0].size(0) == ranks * first.padded_shard().size(0)) {
      input_ = grads[0].contiguous().view({ranks, total});  // no packing needed
    } else {
      input_ = at::empty({ranks, total}, options);
      for (size_t i = 0; i < params_.size(); ++i) {
        params_[i]->pack_for_reduce_scatter(
            grads[i], input_.narrow(1, offsets_[i], params_[i]->reduce_numel()));
      }
    }
    grads.clear();  // the packed input is all that stays alive
    output_ = at::empty({total}, options);
    const bool lend = scratch.defined() && scratch.scalar_type() == input_.scalar_type() &&
                      scratch.numel() >= input_.numel();
    work_ = dist::reduce_scatter(*mesh_.reduce_group, output_, input_.view(-1),
                                 dist::ReduceOp::kSum, lend ? scratch.view(-1) : at::Tensor());
    if (scratch.defined()) work_.then([scratch] { free_storage(scratch); });
    stage_ = Stage::kReduceScatter;
    return;
  }
  if (scratch.defined()) free_storage(scratch);
  if (params_.size() == 1) {
    output_ = grads[0].contiguous().view(-1);
  } else {
    output_ = at::empty({total}, options);
    for (size_t i = 0; i < params_.size(); ++i) {
      output_.narrow(0, offsets_[i], grads[i].numel()).copy_(grads[i].reshape(-1));
    }
  }
  grads.clear();
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
      input_ = at::Tensor();
      if (settings_.average && mesh_.shard_size > 1) output_.div_(mesh_.shard_size);
      start_replica_stage();
      break;
    case Stage::kReplicaAllReduce:
      work_.wait();
      if (settings_.average) output_.div_(mesh_.replicate_size);
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

void GradReduction::assign() {
  for (size_t i = 0; i < params_.size(); ++i) {
    FSDPParam& p = *params_[i];
    at::Tensor grad =
        p.sharded() ? p.unpack_reduced(output_.narrow(0, offsets_[i], p.reduce_numel()))
                    : output_.narrow(0, offsets_[i], p.unsharded_numel()).view(p.full_shape());
    // The optimizer steps the shard: the parameter must hold it.
    p.reshard();
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

bool ReductionQueue::pending_for(const FSDPParam& param) const {
  for (const auto& r : pending_) {
    if (r->covers(param)) return true;
  }
  return false;
}

void ReductionQueue::drop_done() {
  while (!pending_.empty() && pending_.front()->done()) pending_.pop_front();
  // Keep order; done ones in the middle are dropped too.
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = (*it)->done() ? pending_.erase(it) : std::next(it);
  }
}

}  // namespace hp::fsdp
