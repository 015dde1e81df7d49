// Executing a redistribute plan on this rank's local tensor.
//
// Collectives need equal-sized pieces; uneven shards (torch.chunk semantics)
// are padded to the largest piece before the collective and trimmed after,
// so results equal the single-process tensor exactly. Steps never modify
// their input: the result is always a new tensor. Not differentiable by
// itself (DTensor wraps it in autograd nodes).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/mesh/device_mesh.h"
#include "hp/tensor/layout.h"
#include "hp/tensor/redistribute_plan.h"

namespace hp {

at::Tensor execute_redistribute(const RedistributePlan& plan, const at::Tensor& local,
                                const DeviceMesh& mesh, const std::vector<int64_t>& global_shape);

// This rank's shard of a tensor of `global_shape` laid out as `to`, from its
// shard `local` under `from` (the cached plan, executed outside autograd);
// `local` itself when the layouts are equal.
at::Tensor redistribute_local(const at::Tensor& local, const Layout& from, const Layout& to,
                              const std::vector<int64_t>& global_shape);

}  // namespace hp
