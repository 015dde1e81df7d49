// fully_shard over parameters that are already DTensors (F16 in
// docs/features.md): tensor parallelism sharded them over one mesh dim
// ("tp"), fully_shard shards their local pieces again over another ("dp").
//
// The unit works on the local tensor as it works on a plain parameter
// (gather, reduce-scatter, padding), so only two things are new: which dim
// of the local tensor fully_shard may take, and the layout that describes
// the shard over both meshes, which the optimizer state, clip_grad_norm_,
// state dicts and checkpoints see. Both meshes must be sub-meshes of one
// mesh (mesh["dp"] and mesh["tp"] of one init_device_mesh), so that the
// combined layout has a mesh to live on.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hp/fsdp/mesh_info.h"
#include "hp/tensor/layout.h"

namespace hp::fsdp {

// ArgumentError naming `fqn` unless `param_layout`'s mesh and `fsdp_mesh`
// were taken from one mesh and the parameter is Replicate over every mesh
// dim the two share. Local: fully_shard calls it before any collective.
void check_composable(const std::string& fqn, const Layout& param_layout,
                      const DeviceMesh& fsdp_mesh);

// The dim fully_shard shards a DTensor parameter on when no
// shard_placement_fn says otherwise: the first dim its layout does not
// shard, where dim 0 may have any size (it is padded) and other dims must
// divide by `shard_size`. nullopt when every dim is taken (a 1-D bias of a
// column-parallel linear): the parameter is then kept whole over
// fully_shard's mesh, as replicate_params would.
std::optional<int64_t> default_shard_dim(const Layout& param_layout,
                                         const std::vector<int64_t>& local_shape,
                                         int64_t shard_size);

// The layout of what a managed parameter holds between steps: over
// fully_shard's mesh alone for a plain parameter (Shard(shard_dim), or
// Replicate when `shard_dim` is nullopt), else over the sub-mesh of both
// meshes, with the parameter's own placements on its mesh's dims.
Layout shard_layout(const MeshInfo& mesh, const Layout* param_layout, int64_t tensor_ndim,
                    std::optional<int64_t> shard_dim);

}  // namespace hp::fsdp
