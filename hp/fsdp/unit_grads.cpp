#include "hp/fsdp/unit_grads.h"

#include "hp/fsdp/storage.h"

namespace hp::fsdp {

void UnitGrads::begin(const std::vector<std::unique_ptr<FSDPParam>>& params, bool pack,
                      bool pack_whole) {
  reset();
  std::vector<FSDPParam*> sharded, whole;
  for (const auto& p : params) {
    if (!p->requires_grad()) continue;
    ++expected_;
    (p->sharded() ? sharded : whole).push_back(p.get());
  }
  if (!pack) return;
  if (!sharded.empty()) sharded_ = PackedGrads(std::move(sharded));
  if (!whole.empty() && pack_whole) whole_ = PackedGrads(std::move(whole));
}

bool UnitGrads::arrive() {
  ++arrived_;
  return arrived_ == expected_;
}

void UnitGrads::pack(FSDPParam& param, at::Tensor grad, bool defer) {
  if (defer) {
    deferred_.emplace_back(&param, std::move(grad));
    return;
  }
  (param.sharded() ? sharded_ : whole_).add(param, grad);
}

void UnitGrads::flush(ReductionQueue& queue, at::Tensor scratch, const MeshInfo& mesh,
                      ReduceSettings settings, const std::shared_ptr<void>& keep_alive,
                      CommContext* comm) {
  std::vector<std::pair<FSDPParam*, at::Tensor>> sharded_grads;
  for (auto& [param, grad] : deferred_) {
    if (param->sharded()) {
      sharded_grads.emplace_back(param, std::move(grad));
    } else {
      whole_.add(*param, grad);
      grad = at::Tensor();
    }
  }
  deferred_.clear();
  if (!sharded_grads.empty()) sharded_.add_all(std::move(sharded_grads));
  if (!sharded_.empty()) {
    queue.push(std::make_unique<GradReduction>(std::move(sharded_), std::move(scratch), mesh,
                                               settings, wave_, keep_alive, comm));
  } else if (scratch.defined()) {
    // Nothing to reduce-scatter into it: the lent buffer is released here,
    // since the group leaves a lent buffer to its borrower.
    free_storage(scratch);
  }
  if (!whole_.empty()) {
    ReduceSettings over_mesh = settings;
    over_mesh.over_mesh = true;
    queue.push(std::make_unique<GradReduction>(std::move(whole_), at::Tensor(), mesh, over_mesh,
                                               wave_, keep_alive, comm));
  }
  sharded_ = PackedGrads();
  whole_ = PackedGrads();
}

void UnitGrads::reset() {
  expected_ = 0;
  arrived_ = 0;
  wave_ = -1;
  sharded_ = PackedGrads();
  whole_ = PackedGrads();
  deferred_.clear();
}

}  // namespace hp::fsdp
