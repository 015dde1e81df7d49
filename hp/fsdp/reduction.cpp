#include "hp/fsdp/reduction.h"

#include <ATen/ATen.h>

#include "hp/dist/collectives.h"
#include "hp/fsdp/storage.h"

namespace hp::fsdp {

void ReductionQueue::issue(FSDPParam& param, at::Tensor full_grad, at::Tensor scratch,
                           const MeshInfo& mesh, ReduceSettings settings, int64_t wave,
                           std::shared_ptr<void> keep_alive) {
  Pending p{&param, &mesh, settings, wave, std::move(keep_alive), {}, {}, {}, std::move(scratch)};
  if (param.sharded()) {
    p.input = param.pack_for_reduce_scatter(full_grad);
    full_grad = at::Tensor();  // the packed input is all that stays alive
    p.output = at::empty(param.padded_shard().sizes(), p.input.options());
    const bool lend = p.scratch.defined() && p.scratch.scalar_type() == p.input.scalar_type() &&
                      p.scratch.numel() >= p.input.numel();
    p.work = dist::reduce_scatter(*mesh.reduce_group, p.output, p.input, dist::ReduceOp::kSum,
                                  lend ? p.scratch : at::Tensor());
  } else {
    // Replicated parameters all-reduce over the shard ranks first (they hold
    // the same parameter and different data); shard groups of one skip it.
    p.output = full_grad.contiguous();
    if (param.replicated() && mesh.shard_size > 1) {
      p.work = dist::all_reduce(*mesh.reduce_group, p.output, dist::ReduceOp::kSum);
    }
  }
  pending_.push_back(std::move(p));
}

void ReductionQueue::complete(Pending& p) {
  p.work.wait();
  p.input = at::Tensor();
  if (p.scratch.defined()) free_storage(p.scratch);
  FSDPParam& param = *p.param;
  const MeshInfo& mesh = *p.mesh;
  at::Tensor grad;
  int64_t contributors = 1;
  if (param.sharded()) {
    grad = param.unpack_reduced(p.output);
    contributors = mesh.shard_size;
  } else {
    grad = p.output;
    if (param.replicated()) contributors = mesh.shard_size;
  }
  if (p.settings.average && contributors > 1) grad.div_(contributors);
  if (mesh.has_replicas()) {
    at::Tensor& partial = param.partial_reduce();
    if (!p.settings.all_reduce) {
      // Accumulate locally; a later backward with all-reduce adds it in.
      partial = partial.defined() ? partial + grad : grad.clone();
      param.reshard();
      param.restore_stash();
      return;
    }
    at::Tensor total = (partial.defined() ? grad + partial : grad).contiguous();
    partial = at::Tensor();
    dist::all_reduce(*mesh.replicate_group, total, dist::ReduceOp::kSum).wait();
    if (p.settings.average) total.div_(mesh.replicate_size);
    grad = total;
  }
  // The optimizer sees the shard: make sure the parameter holds it.
  param.reshard();
  param.assign_grad(grad);
}

void ReductionQueue::complete_before(int64_t wave) {
  while (!pending_.empty() && pending_.front().wave < wave) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    complete(p);
  }
}

void ReductionQueue::complete_all() {
  while (!pending_.empty()) {
    Pending p = std::move(pending_.front());
    pending_.pop_front();
    complete(p);
  }
}

bool ReductionQueue::pending_for(const FSDPParam& param) const {
  for (const auto& p : pending_) {
    if (p.param == &param) return true;
  }
  return false;
}

}  // namespace hp::fsdp
