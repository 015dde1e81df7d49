// Gradient clipping across shards.
//
// The norm of a sharded model's gradient is the norm of all shards
// together: squared norms of sharded parameters are summed over their shard
// group, those of DTensor gradients (tensor parallelism, alone or under
// fully_shard) over every mesh dim their layout shards; replicated
// gradients (identical on every rank) count once.
// Under pipeline parallelism each rank holds only its stages' parameters:
// the norms of the ranks of `across` (the pipeline dimension's group) add up
// to the model's, so the total is summed over it (or its maximum taken for
// the infinity norm) before the root. The sum's order differs from one
// process's, so the norm may differ from it in the last bits.
// Collective: every rank calls it with the same parameters (their shards).
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/distributed/group.h"

namespace hp {

// Scales the gradients so that their global norm is at most max_norm and
// returns the global norm before scaling, as a 0-d double tensor (as
// torch.nn.utils.clip_grad_norm_ in Python). Everything stays on the
// gradients' device: no host sync (except for gradients offloaded to the
// CPU, which wait for the norm), so the CPU runs on into the optimizer
// step; call .item<double>() on the result only where the value is needed
// on the host (a log line). The norm is on the device of the collectives
// (the GPU for NCCL groups), or of the first gradient when none is sharded;
// a model without gradients gets a CPU zero. norm_type is 2.0 (Euclidean)
// or infinity.
at::Tensor clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                           double norm_type = 2.0, const dist::GroupPtr& across = nullptr);

}  // namespace hp
