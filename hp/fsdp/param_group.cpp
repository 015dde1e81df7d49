#include "hp/fsdp/param_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <utility>

#include "hp/distributed/collectives.h"
#include "hp/fsdp/storage.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp::fsdp {

ParamGroup::ParamGroup(std::vector<FSDPParam*> params, const MeshInfo& mesh, Options options)
    : params_(std::move(params)), mesh_(mesh), options_(options) {
  for (FSDPParam* p : params_) {
    if (p->sharded()) sharded_.push_back(p);
  }
  if (!options_.fused || sharded_.empty()) return;
  // Fused layout: one flat unsharded buffer with every parameter's buffer a
  // view, param after param; with zero-copy, one flat shard buffer too.
  const at::ScalarType compute = sharded_[0]->compute_dtype();
  for (FSDPParam* p : sharded_) {
    unsharded_offsets_.push_back(unsharded_total_);
    unsharded_total_ += p->unsharded_numel();
    shard_offsets_.push_back(shard_total_);
    shard_total_ += p->reduce_numel();
  }
  // No memory until the first gather: a unit built over a meta model (F17)
  // must not allocate its unsharded size at fully_shard.
  flat_unsharded_ = empty_unallocated({unsharded_total_}, sharded_[0]->compute_options(compute));
  for (size_t i = 0; i < sharded_.size(); ++i) {
    sharded_[i]->set_external_unsharded(
        flat_unsharded_.narrow(0, unsharded_offsets_[i], sharded_[i]->unsharded_numel()));
  }
  free_storage(flat_unsharded_);
  if (options_.zero_copy) {
    const FSDPParam& first = *sharded_[0];
    flat_shards_ = at::empty({shard_total_},
                             first.padded_shard().options().pinned_memory(first.pinned()));
    for (size_t i = 0; i < sharded_.size(); ++i) {
      const at::Tensor& shard = sharded_[i]->padded_shard();
      sharded_[i]->rebase_shard(
          flat_shards_.narrow(0, shard_offsets_[i], shard.numel()).view(shard.sizes()));
    }
    // The gather input: the shards cast to the compute dtype, or copied to
    // the device when they are offloaded to host memory.
    if (compute != flat_shards_.scalar_type() || first.offloaded()) {
      flat_cast_ = at::empty({shard_total_}, first.compute_options(compute));
    }
  }
}

void ParamGroup::materialize(const std::function<at::Tensor(FSDPParam&)>& new_param_for) {
  if (!flat_shards_.defined() || !flat_shards_.is_meta()) return;
  const FSDPParam& first = *sharded_[0];
  flat_shards_ = at::empty({shard_total_}, flat_shards_.options()
                                               .device(first.shard_device())
                                               .pinned_memory(first.pinned()));
  flat_shards_.zero_();  // the padding is gathered as it is
  for (size_t i = 0; i < sharded_.size(); ++i) {
    FSDPParam& p = *sharded_[i];
    p.materialize(flat_shards_.narrow(0, shard_offsets_[i], p.reduce_numel())
                      .view(p.padded_shard().sizes()),
                  new_param_for(p));
  }
}

ParamGroup::~ParamGroup() {
  for (auto& work : works_) {
    try {
      work.wait();
    } catch (const std::exception&) {
      // Destruction cannot report it; the unit is going away.
    }
  }
}

void ParamGroup::ensure_flat_unsharded() {
  lent_ = false;  // the borrower is done (callers complete its reduction first)
  allocate_storage(flat_unsharded_, static_cast<size_t>(unsharded_total_) *
                                        flat_unsharded_.element_size());
}

void ParamGroup::release_flat_unsharded() {
  if (flat_unsharded_.defined() && !lent_ && !flat_kept_) free_storage(flat_unsharded_);
}

bool ParamGroup::use_kept_copies() {
  const bool all_current = std::all_of(params_.begin(), params_.end(), [](FSDPParam* p) {
    return !p->holds_kept_copy() || p->kept_copy_is_current();
  });
  for (FSDPParam* p : params_) {
    if (!p->holds_kept_copy()) continue;
    // A fused unit gathers its sharded parameters as one: a single changed
    // shard means gathering them all again.
    const bool usable = p->kept_copy_is_current() && (all_current || !flat_kept_ || !p->sharded());
    if (usable) {
      p->use_kept_copy();
    } else {
      p->release_kept();
    }
  }
  flat_kept_ = false;  // used, or about to be refilled by the gather
  return !all_current;
}

bool ParamGroup::begin_unshard(dist::Group* regather_group, bool snapshot, CommContext* comm) {
  if (in_flight_) return false;
  if (comm != nullptr && comm->streams() != nullptr) comm_ = comm;
  const bool stale = use_kept_copies();
  in_flight_ = true;
  arriving_.clear();
  for (FSDPParam* p : params_) {
    if (!p->sharded() && p->data() != FSDPParam::Data::kUnsharded) {
      p->cast_into_unsharded();
      arriving_.push_back(p);
    }
  }
  std::vector<FSDPParam*> todo;
  for (FSDPParam* p : sharded_) {
    if (p->data() != FSDPParam::Data::kUnsharded) todo.push_back(p);
  }
  arriving_.insert(arriving_.end(), todo.begin(), todo.end());
  if (todo.empty()) return stale;
  const bool regather = todo[0]->regather_piece().defined();
  dist::Group& group = regather ? *regather_group : *mesh_.shard_group;
  auto input_of = [regather, snapshot](FSDPParam* p) {
    return regather ? p->regather_piece() : p->shard_gather_input(snapshot);
  };
  if (comm_ != nullptr) {
    issue_on_streams(group, todo, regather, snapshot);
    return stale;
  }
  if (!options_.fused) {
    for (FSDPParam* p : todo) works_.push_back(p->gather(group, input_of(p)));
    return stale;
  }
  // One collective for the unit. Fused groups always gather all their
  // parameters together: they are unsharded and resharded as one. The
  // backend copies each rank's piece straight into the parameters'
  // unsharded buffers (views of the flat buffer): no separate output.
  ensure_flat_unsharded();
  std::vector<at::Tensor> inputs;
  if (!regather && flat_shards_.defined()) {
    at::Tensor flat = flat_cast_.defined() ? flat_cast_.copy_(flat_shards_)
                      : snapshot          ? flat_shards_.clone()
                                          : flat_shards_;
    for (size_t i = 0; i < sharded_.size(); ++i) {
      const at::Tensor& shard = sharded_[i]->padded_shard();
      inputs.push_back(flat.narrow(0, shard_offsets_[i], shard.numel()).view(shard.sizes()));
    }
  } else {
    for (FSDPParam* p : sharded_) inputs.push_back(input_of(p));
  }
  const int64_t pieces = group.size();
  std::vector<std::vector<at::Tensor>> outputs(pieces);
  for (int64_t r = 0; r < pieces; ++r) {
    for (FSDPParam* p : sharded_) outputs[r].push_back(p->unsharded_piece(pieces, r));
  }
  works_.push_back(dist::all_gather_coalesced(group, outputs, inputs));
  return stale;
}

void ParamGroup::issue_on_streams(dist::Group& group, const std::vector<FSDPParam*>& todo,
                                  bool regather, bool snapshot) {
  using dist::StreamRole;
  dist::StreamOps* ops = comm_->streams();
  // The previous unit's output goes first: at most two are live.
  comm_->release_all_gather_output();
  ops->wait(StreamRole::kCopyIn, reshard_event_);
  reshard_event_ = {};
  const bool fused = options_.fused;
  gathered_ = fused ? sharded_ : todo;
  gather_fused_ = fused;
  gather_ranks_ = group.size();
  dist::StreamScope on_copy_in(ops, StreamRole::kCopyIn);
  // Copy-in: the inputs in the compute dtype (casts, host-to-device copies
  // and snapshots run here, off the compute stream).
  gather_inputs_.clear();
  gather_offsets_.clear();
  gather_rank_numel_ = 0;
  for (size_t i = 0; i < gathered_.size(); ++i) {
    FSDPParam* p = gathered_[i];
    at::Tensor input;
    if (!regather && p->offloaded()) {
      input = p->shard_gather_input(snapshot, /*non_blocking=*/true);
      comm_->note_offload_copy();  // the host shard is read until the host waits
    } else if (!regather && fused && flat_shards_.defined()) {
      const at::Tensor& shard = p->padded_shard();
      input = shard.to(p->compute_dtype(), /*non_blocking=*/false, /*copy=*/snapshot);
      if (input.device() != p->compute_device()) input = input.to(p->compute_device());
    } else {
      input = regather ? p->regather_piece() : p->shard_gather_input(snapshot);
    }
    gather_offsets_.push_back(gather_rank_numel_);
    gather_rank_numel_ += input.numel();
    gather_inputs_.push_back(input.reshape(-1));
  }
  const at::TensorOptions options = gather_inputs_[0].options();
  gather_output_ = at::empty({gather_ranks_ * gather_rank_numel_}, options);
  ops->on_alloc(gather_output_.data_ptr(), StreamRole::kCopyIn, "all-gather output");
  ops->wait_stream(StreamRole::kAllGather, StreamRole::kCopyIn, "copy in");
  dist::StreamScope on_all_gather(ops, StreamRole::kAllGather);
  ops->on_use(gather_output_.data_ptr(), StreamRole::kAllGather);
  if (fused) {
    // One collective: every parameter's input, concatenated.
    at::Tensor input = gather_inputs_.size() == 1 ? gather_inputs_[0] : at::cat(gather_inputs_);
    gather_inputs_.push_back(input);
    works_.push_back(dist::all_gather_into(group, gather_output_, input));
    return;
  }
  // One collective per parameter, each into its own rank-major slice.
  for (size_t i = 0; i < gathered_.size(); ++i) {
    const int64_t n = gather_inputs_[i].numel();
    works_.push_back(dist::all_gather_into(
        group, gather_output_.narrow(0, gather_ranks_ * gather_offsets_[i], gather_ranks_ * n),
        gather_inputs_[i]));
  }
}

void ParamGroup::copy_out_from_streams(bool keep_output) {
  using dist::StreamRole;
  dist::StreamOps* ops = comm_->streams();
  for (auto& work : works_) work.wait_on(StreamRole::kCompute);
  works_.clear();
  if (!gather_output_.defined()) return;
  ops->on_use(gather_output_.data_ptr(), StreamRole::kCompute);
  if (gather_fused_) ensure_flat_unsharded();
#if HP_TORCH_AT_LEAST(2, 1)
  const bool all_dim0 = std::all_of(gathered_.begin(), gathered_.end(),
                                    [](const FSDPParam* p) { return p->shard_dim() == 0; });
  if (gather_fused_ && all_dim0) {
    // One kernel: column block i of the [ranks, total] output is parameter
    // i's [ranks, piece] rows, which is its unsharded buffer viewed so.
    std::vector<int64_t> sizes;
    std::vector<at::Tensor> outs;
    for (size_t i = 0; i < gathered_.size(); ++i) {
      sizes.push_back(gather_inputs_[i].numel());
      outs.push_back(gathered_[i]->ensure_unsharded().view({gather_ranks_, sizes.back()}));
    }
    at::split_with_sizes_copy_out(outs, gather_output_.view({gather_ranks_, gather_rank_numel_}),
                                  sizes, 1);
    gathered_.clear();  // copied out: the loop below has nothing left
  }
#endif
  for (size_t i = 0; i < gathered_.size(); ++i) {
    FSDPParam* p = gathered_[i];
    const int64_t n = gather_inputs_[i].numel();
    // Row g of `pieces`: group rank g's piece of this parameter.
    at::Tensor pieces =
        gather_fused_
            ? gather_output_.view({gather_ranks_, gather_rank_numel_}).narrow(1, gather_offsets_[i], n)
            : gather_output_.narrow(0, gather_ranks_ * gather_offsets_[i], gather_ranks_ * n)
                  .view({gather_ranks_, n});
    if (!gather_fused_) p->ensure_unsharded();
    p->copy_out(pieces);
  }
  const dist::StreamEvent copy_out = ops->record(StreamRole::kCompute, "copy out");
  comm_->keep_all_gather_output(std::exchange(gather_output_, at::Tensor()), copy_out,
                                std::exchange(gather_inputs_, {}));
  if (!keep_output) comm_->release_all_gather_output();
  gathered_.clear();
}

void ParamGroup::record_reshard() {
  if (comm_ == nullptr) return;
  reshard_event_ = comm_->streams()->record(dist::StreamRole::kCompute, "reshard");
}

void ParamGroup::finish_unshard(bool keep_output) {
  if (!in_flight_) return;
  if (comm_ != nullptr) {
    copy_out_from_streams(keep_output);
  } else {
    for (auto& work : works_) work.wait();
    works_.clear();
    for (FSDPParam* p : arriving_) p->finish_gather();
  }
  for (FSDPParam* p : arriving_) {
    p->drop_regather_piece();
    p->use_unsharded();
  }
  arriving_.clear();
  in_flight_ = false;
}

void ParamGroup::forget_in_flight() {
  works_.clear();
  gather_output_ = at::Tensor();
  gather_inputs_.clear();
  gathered_.clear();
  arriving_.clear();
  in_flight_ = false;
}

void ParamGroup::free_unsharded() {
  for (FSDPParam* p : params_) p->free_unsharded();
  if (options_.fused) release_flat_unsharded();
  record_reshard();
}

void ParamGroup::keep_for_regather(int64_t pieces, int64_t index) {
  for (FSDPParam* p : sharded_) {
    if (p->data() == FSDPParam::Data::kUnsharded) p->keep_regather_piece(pieces, index);
  }
  free_unsharded();
}

void ParamGroup::reshard(bool keep_copies) {
  finish_unshard();
  for (FSDPParam* p : params_) {
    p->reshard();
    if (!keep_copies) p->release_kept();
    p->drop_regather_piece();
  }
  if (!keep_copies) flat_kept_ = false;
  if (options_.fused) release_flat_unsharded();
}

void ParamGroup::reshard_keeping_unsharded() {
  finish_unshard();
  for (FSDPParam* p : params_) p->reshard_keeping_unsharded();
  // A fused group's copies are views of the flat buffer: it stays.
  flat_kept_ = options_.fused && std::any_of(sharded_.begin(), sharded_.end(), [](FSDPParam* p) {
                 return p->holds_kept_copy();
               });
}

at::Tensor ParamGroup::reshard_lending_flat_buffer() {
  if (!options_.fused || sharded_.empty() || !storage_is_allocated(flat_unsharded_)) {
    reshard();
    return at::Tensor();
  }
  for (FSDPParam* p : params_) {
    p->reshard();  // external buffers: the flat memory stays
    p->drop_regather_piece();
  }
  lent_ = true;
  return flat_unsharded_;
}

}  // namespace hp::fsdp
