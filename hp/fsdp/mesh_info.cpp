#include "hp/fsdp/mesh_info.h"

#include "hp/distributed/world.h"
#include "hp/util/error.h"

namespace hp::fsdp {

int64_t MeshInfo::checked_shard_size(const DeviceMesh& mesh) {
  HP_CHECK_ARG(mesh.ndim() == 1 || mesh.ndim() == 2,
               "fully_shard expects a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), "
               "got a ",
               mesh.ndim(), "-D mesh ", to_string(mesh.dim_names()));
  HP_CHECK_ARG(mesh.contains_self(), "fully_shard: rank ", dist::get_rank(),
               " is not part of ", mesh.describe());
  return mesh.size(mesh.ndim() - 1);
}

MeshInfo MeshInfo::from_mesh(DeviceMeshPtr mesh, bool with_mesh_group) {
  checked_shard_size(*mesh);
  MeshInfo info;
  info.mesh = mesh;
  const int64_t shard_dim = mesh->ndim() - 1;
  info.shard_size = mesh->size(shard_dim);
  info.shard_rank = mesh->coordinate(shard_dim);
  info.shard_group = mesh->group_ptr(shard_dim);
  const auto& shard_ranks = info.shard_group->ranks();
  // Same backend as the mesh (NCCL for a 'cuda' mesh): on NCCL a separate
  // group is a separate communication stream too.
  dist::GroupOptions reduce;
  reduce.tag = "fsdp-reduce";
  reduce.backend = mesh->backend_type();
  info.reduce_group = dist::new_group(shard_ranks, reduce);
  if (mesh->ndim() == 2) {
    info.replicate_size = mesh->size(0);
    dist::GroupOptions all_reduce;
    all_reduce.tag = "fsdp-allreduce";
    all_reduce.backend = mesh->backend_type();
    info.replicate_group = dist::new_group(mesh->group(0).ranks(), all_reduce);
  }
  if (with_mesh_group) {
    if (!info.has_replicas()) {
      info.mesh_group = info.reduce_group;
    } else if (info.shard_size == 1) {
      info.mesh_group = info.replicate_group;
    } else {
      // Its own tag: a separate stream beside the reduce-scatters and the
      // replicas' all-reduces it pipelines with.
      dist::GroupOptions whole;
      whole.tag = "fsdp-allreduce-mesh";
      whole.backend = mesh->backend_type();
      info.mesh_group = dist::new_group(mesh->ranks(), whole);
    }
  }
  return info;
}

Placements MeshInfo::placements(int64_t dim) const {
  if (mesh->ndim() == 2) return {Replicate(), Shard(dim)};
  return {Shard(dim)};
}

Placements MeshInfo::replicated_placements() const {
  return Placements(mesh->ndim(), Replicate());
}

}  // namespace hp::fsdp
