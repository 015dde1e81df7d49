// Gradient reduction of fully_shard units (SPEC F4, F5).
//
// After autograd accumulates a parameter's full gradient, the unit hands it
// here: sharded parameters are reduce-scattered over the shard group (and,
// for HSDP, all-reduced over the replicate group); replicated ones are
// all-reduced. Collectives are issued asynchronously on the reduction
// groups and completed later, so a unit's reduction overlaps the backward
// compute of the units before it. To bound memory, issuing the first
// gradient of unit k completes everything issued before unit k-1.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>

#include <ATen/core/Tensor.h>

#include "hp/dist/work.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/mesh_info.h"

namespace hp::fsdp {

struct ReduceSettings {
  bool average = true;     // "avg": divide by the number of contributing ranks
  bool all_reduce = true;  // HSDP/DDP: all-reduce over replicas now
};

class ReductionQueue {
 public:
  // Issues the reduction of `full_grad` for `param`. `keep_alive` holds the
  // owner of `param` and `mesh` until the reduction completes. `wave` is the
  // order in which units started their post-backward in this backward pass.
  void issue(FSDPParam& param, at::Tensor full_grad, const MeshInfo& mesh,
             ReduceSettings settings, int64_t wave, std::shared_ptr<void> keep_alive);
  // Completes what units before `wave - 1` issued.
  void complete_before(int64_t wave);
  void complete_all();
  bool empty() const { return pending_.empty(); }
  // Whether `param` has a reduction in flight.
  bool pending_for(const FSDPParam& param) const;

 private:
  struct Pending {
    FSDPParam* param;
    const MeshInfo* mesh;
    ReduceSettings settings;
    int64_t wave;
    std::shared_ptr<void> keep_alive;
    dist::Work work;
    at::Tensor input;   // kept alive until the collective completes
    at::Tensor output;  // reduce-scatter output row, or the all-reduced buffer
  };
  void complete(Pending& p);

  std::deque<Pending> pending_;
};

}  // namespace hp::fsdp
