// Which ranks a fully_shard unit shards over and which it replicates over.
//
// A 1-D mesh shards over its one dim (FSDP). A 2-D mesh replicates over dim
// 0 and shards over dim 1 (HSDP); with a shard dim of size 1 that is plain
// data parallelism (DDP). Gradient reductions run on their own process
// groups (same ranks, separate Gloo contexts or NCCL communicators, each
// with its own stream), so a reduction in flight never delays the next
// all-gather: FSDP2's separate communication streams.
#pragma once

#include <cstdint>

#include "hp/distributed/group.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/placement.h"

namespace hp::fsdp {

struct MeshInfo {
  DeviceMeshPtr mesh;
  int64_t shard_size = 1;
  int64_t shard_rank = 0;
  int64_t replicate_size = 1;
  dist::GroupPtr shard_group;       // all-gathers
  dist::GroupPtr reduce_group;      // reduce-scatters (shard ranks)
  dist::GroupPtr replicate_group;   // all-reduces over replicas; null without replicas
  // All-reduces over every rank of the mesh: comm_fusion's bucket of whole
  // parameters (replicate_params) reduces there in one collective. The
  // reduce group (FSDP) or the replicate group (DDP) when one of them spans
  // the mesh, else a group of its own (HSDP); null unless from_mesh was
  // asked for it.
  dist::GroupPtr mesh_group;

  // Checks that this rank can shard over `mesh` (1-D or 2-D, this rank in
  // it) and returns the size of its shard dim. Local: no collectives, so
  // fully_shard can finish every check before it creates any group.
  static int64_t checked_shard_size(const DeviceMesh& mesh);
  // Collective over every rank that builds a unit on this mesh (each asks
  // for the same `with_mesh_group`).
  static MeshInfo from_mesh(DeviceMeshPtr mesh, bool with_mesh_group = false);

  bool has_replicas() const { return replicate_size > 1; }
  // The number of ranks of the mesh (shard ranks times replicas).
  int64_t size() const { return shard_size * replicate_size; }
  // The DTensor placements of a parameter sharded on `dim`.
  Placements placements(int64_t dim) const;
  Placements replicated_placements() const;
};

}  // namespace hp::fsdp
