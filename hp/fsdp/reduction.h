// Gradient reduction of fully_shard units (SPEC F4, F5).
//
// After autograd accumulates a parameter's full gradient, the unit hands it
// here: sharded parameters are reduce-scattered over the shard group (and,
// for HSDP, all-reduced over the replicate group); replicated ones are
// all-reduced. Collectives are issued asynchronously on the reduction
// groups and completed later, so a unit's reduction overlaps the backward
// compute of the unit before it, until that unit's first gradient arrives:
// then the previous unit's reductions complete. That keeps the unsharded
// working set at about two units (issue 3's memory bound); the all-to-all
// of a reduce-scatter receives into the parameter's own unsharded buffer,
// which autograd no longer needs, rather than a new allocation.
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
  // `scratch`: the parameter's lent unsharded buffer (may be undefined);
  // its memory is released when the reduction completes.
  void issue(FSDPParam& param, at::Tensor full_grad, at::Tensor scratch, const MeshInfo& mesh,
             ReduceSettings settings, int64_t wave, std::shared_ptr<void> keep_alive);
  // Completes what units before `wave` issued.
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
    at::Tensor scratch; // lent unsharded buffer, released on completion
  };
  void complete(Pending& p);

  std::deque<Pending> pending_;
};

}  // namespace hp::fsdp
