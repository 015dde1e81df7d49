// Gradient clipping across shards.
//
// The norm of a sharded model's gradient is the norm of all shards
// together: squared norms of sharded parameters are summed over their shard
// group, those of DTensor gradients (tensor parallelism, alone or under
// fully_shard) over every mesh dim their layout shards; replicated
// gradients (identical on every rank) count once.
// Collective: every rank calls it with the same parameters.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace hp {

// Scales the gradients so that their global norm is at most max_norm and
// returns the global norm before scaling (as torch.nn.utils.clip_grad_norm_).
// norm_type is 2.0 (Euclidean) or infinity.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type = 2.0);

}  // namespace hp
