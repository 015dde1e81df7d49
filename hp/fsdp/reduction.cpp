#include "hp/fsdp/reduction.h"

#include <ATen/ATen.h>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/storage.h"
#include "hp/util/torch_compat.h"

#include <algorithm>
#include <utility>

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

bool PackedGrads::add_all(std::vector<std::pair<FSDPParam*, at::Tensor>> grads) {
#if HP_TORCH_AT_LEAST(2, 4)
  // _chunk_cat pads each gradient's dim 0 to shard_size chunks of
  // ceil(size / shard_size) rows: FSDPParam's padded shard along dim 0, so
  // column block i of its output is what add() would write for params_[i].
  const bool one_kernel =
      sharded_ && !data_.defined() && grads.size() == params_.size() &&
      std::all_of(params_.begin(), params_.end(), [&](const FSDPParam* p) {
        return p->shard_dim() == 0 && p->reduce_numel() > 0 &&
               std::count_if(grads.begin(), grads.end(),
                             [p](const auto& g) { return g.first == p; }) == 1;
      });
  if (one_kernel) {
    std::vector<at::Tensor> ordered(params_.size());
    for (auto& [param, grad] : grads) {
      const size_t i = std::find(params_.begin(), params_.end(), param) - params_.begin();
      ordered[i] = std::move(grad);
    }
    // The op takes one input dtype (and casts to the output's); a unit whose
    // gradients differ casts the others to the reduce dtype first.
    const at::ScalarType first = ordered[0].scalar_type();
    const bool mixed = std::any_of(ordered.begin(), ordered.end(),
                                   [first](const at::Tensor& g) { return g.scalar_type() != first; });
    if (mixed) {
      for (at::Tensor& g : ordered) g = g.to(params_[0]->reduce_dtype());
    }
    allocate();  // every block written whole: not zeroed
    at::_chunk_cat_out(data_, ordered, 0, params_[0]->shard_size());
    arrived_.assign(params_.size(), true);
    return true;
  }
#endif
  for (auto& [param, grad] : grads) {
    add(*param, grad);
    grad = at::Tensor();
  }
  return false;
}

GradReduction::GradReduction(PackedGrads grads, at::Tensor scratch, const MeshInfo& mesh,
                             ReduceSettings settings, int64_t wave,
                             std::shared_ptr<void> keep_alive, CommContext* comm)
    : mesh_(mesh), settings_(settings), wave_(wave), keep_alive_(std::move(keep_alive)) {
  if (comm != nullptr) ops_ = comm->streams();
  if (ops_ != nullptr) comm_ = comm;
  // Every block is set before the collective (so before `grads` gives up
  // its parameters): the buffer allocated if no gradient arrived, and the
  // blocks of the parameters without one zeroed.
  if (!grads.data_.defined()) grads.allocate();
  grads.zero_missing();
  params_ = std::move(grads.params_);
  offsets_ = std::move(grads.offsets_);
  arrived_ = std::move(grads.arrived_);
  if (ops_ != nullptr) {
    // Streams: no lending (the reduce-scatter's output is allocated on its
    // own stream), every stage issued now, chained stream to stream.
    if (scratch.defined()) free_storage(scratch);
    issue_on_streams(std::move(grads), *comm);
    return;
  }
  if (grads.sharded_) {
    // The input is held by the collective only, so it is released the moment
    // the reduce-scatter completes (on the backend's thread), not when this
    // reduction is next advanced.
    at::Tensor input = std::move(grads.data_);
    output_ = at::empty({grads.total_}, input.options());
    const bool lend = scratch.defined() && scratch.scalar_type() == input.scalar_type() &&
                      scratch.numel() >= input.numel() &&
                      dist::reduce_scatter_uses_scratch(*mesh_.reduce_group, input);
    work_ = dist::reduce_scatter(*mesh_.reduce_group, output_, input.view(-1),
                                 dist::ReduceOp::kSum, lend ? scratch.view(-1) : at::Tensor());
    if (lend) {
      scratch_ = std::move(scratch);  // released once the reduce-scatter was waited
    } else if (scratch.defined()) {
      free_storage(scratch);  // not received into: no reason to hold it
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

dist::ReduceOp GradReduction::first_op(const dist::Group& group) const {
  // NCCL averages itself (dist::reduce_scatter), which saves the division's
  // kernel; elsewhere the sum is divided after, as on the host path.
  const bool native = group.backend_type() == dist::BackendType::kNccl;
  return settings_.average && native ? dist::ReduceOp::kAvg : dist::ReduceOp::kSum;
}

void GradReduction::issue_on_streams(PackedGrads grads, CommContext& comm) {
  using dist::StreamRole;
  // The first stage reads the packed gradients (written on compute) on the
  // reduce-scatter stream; an average is divided there too.
  const bool sharded = grads.sharded_;
  at::Tensor input = std::move(grads.data_);
  // A sharded input is released once read (keep_reduce_scatter_input); the
  // whole parameters' buffer is reduced in place and becomes the gradients.
  if (sharded) ops_->on_alloc(input.data_ptr(), StreamRole::kCompute, "reduce-scatter input");
  ops_->wait_stream(StreamRole::kReduceScatter, StreamRole::kCompute, "pack done");
  dist::Group* first_group = nullptr;
  int64_t first_size = 1;
  {
    dist::StreamScope on_rs(ops_, StreamRole::kReduceScatter);
    if (sharded) ops_->on_use(input.data_ptr(), StreamRole::kReduceScatter);
    if (sharded) {
      output_ = at::empty({grads.total_}, input.options());
      first_group = mesh_.reduce_group.get();
      first_size = mesh_.shard_size;
      work_ = dist::reduce_scatter(*first_group, output_, input.view(-1), first_op(*first_group));
    } else {
      output_ = input;
      if (settings_.over_mesh && mesh_.size() > 1) {
        first_group = mesh_.mesh_group.get();
        first_size = mesh_.size();
      } else if (!settings_.over_mesh && params_[0]->replicated() && mesh_.shard_size > 1) {
        first_group = mesh_.reduce_group.get();
        first_size = mesh_.shard_size;
      }
      if (first_group != nullptr) work_ = dist::all_reduce(*first_group, output_, first_op(*first_group));
    }
    if (first_group != nullptr && settings_.average && first_size > 1 &&
        first_op(*first_group) != dist::ReduceOp::kAvg) {
      // The host path divides after its wait; here the division follows
      // the collective on its stream (on Gloo the wait blocks the host).
      work_.wait_on(StreamRole::kReduceScatter);
      output_.div_(first_size);
    }
  }
  post_reduce_ = work_.event();
  if (sharded) {
    // Read on the reduce-scatter stream until its event: kept, up to the
    // cap, before compute may reuse the memory.
    comm.keep_reduce_scatter_input(std::move(input), work_.event());
  }
  const bool replica_stage = !settings_.over_mesh && mesh_.has_replicas() && settings_.all_reduce;
  if (replica_stage) {
    // HSDP / DDP: the replicas' all-reduce waits the first stage's stream,
    // never compute.
    work_.wait_on(StreamRole::kAllReduce);
    dist::StreamScope on_ar(ops_, StreamRole::kAllReduce);
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& partial = params_[i]->partial_reduce();
      if (!partial.defined()) continue;
      output_.narrow(0, offsets_[i], partial.numel()).add_(partial);
      partial = at::Tensor();
    }
    const dist::ReduceOp op = first_op(*mesh_.replicate_group);
    work_ = dist::all_reduce(*mesh_.replicate_group, output_, op);
    if (settings_.average && op != dist::ReduceOp::kAvg) {
      work_.wait_on(StreamRole::kAllReduce);
      output_.div_(mesh_.replicate_size);
    }
    post_reduce_ = ops_->record(StreamRole::kAllReduce, "post reduce");
  } else if (first_group != nullptr) {
    post_reduce_ = ops_->record(StreamRole::kReduceScatter, "post reduce");
  }
  stage_ = Stage::kOnStreams;
}

void GradReduction::start_replica_stage() {
  if (!mesh_.has_replicas()) {
    assign();
    return;
  }
  if (!settings_.all_reduce) {
    keep_partial();
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

void GradReduction::keep_partial() {
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
  keep_alive_.reset();
}

bool GradReduction::advance() {
  switch (stage_) {
    case Stage::kReduceScatter:
    case Stage::kShardAllReduce:
      work_.wait();
      if (scratch_.defined()) free_storage(std::exchange(scratch_, at::Tensor()));
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
    case Stage::kOnStreams:
      // Everything is issued; only the end of backward (complete) waits.
      break;
    case Stage::kDone:
      break;
  }
  return stage_ == Stage::kDone;
}

void GradReduction::complete() {
  if (stage_ == Stage::kOnStreams) {
    // Compute waits the last stage's event (once); on Gloo the host blocks
    // until the collectives finished.
    work_.wait_on(dist::StreamRole::kCompute);
    ops_->wait(dist::StreamRole::kCompute, post_reduce_);
    const bool replicas_later = !settings_.over_mesh && mesh_.has_replicas() && !settings_.all_reduce;
    if (replicas_later) {
      keep_partial();
    } else {
      assign(/*non_blocking=*/true);
    }
    return;
  }
  while (!advance()) {
  }
}

bool GradReduction::abandon() noexcept {
  bool waited = true;
  try {
    if (stage_ != Stage::kDone) work_.wait_on(dist::StreamRole::kCompute);
    if (ops_ != nullptr) ops_->wait(dist::StreamRole::kCompute, post_reduce_);
  } catch (...) {
    waited = false;
  }
  output_ = at::Tensor();
  scratch_ = at::Tensor();
  stage_ = Stage::kDone;
  keep_alive_.reset();
  return waited;
}

void GradReduction::assign(bool non_blocking) {
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
    if (p.assign_grad(alias_of(grad), non_blocking) && comm_ != nullptr) {
      comm_->note_offload_copy();
    }
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
    // On streams the reduce-scatter input cap bounds memory instead.
    if (r->wave() < wave && !r->on_streams()) r->complete();
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
