// Layout: a DeviceMesh plus how each of its dims holds a tensor (T2).
//
// Three equivalent spellings:
//  - placements: one Placement per mesh dim, e.g. [Shard(0), Replicate()];
//  - the alias form: one entry per tensor dim naming the mesh dims that shard
//    it: "dp", "None" (not sharded), or a tuple {"dp", "tp"} for a tensor dim
//    sharded over several mesh dims, the last name varying fastest;
//  - tensor_map (MindSpore's convention): per tensor dim, -1 when not sharded,
//    else the sharding mesh dims counted from the right (mesh dim m of an
//    n-d mesh is n-1-m), several for multi-axis sharding.
// The alias form and tensor_map cannot express Partial; converting a layout
// with a Partial placement to them raises ArgumentError.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hp/mesh/device_mesh.h"
#include "hp/tensor/placement.h"
#include "hp/tensor/shard_spec.h"

namespace hp {

// One tensor dim in the alias form: {} or {"None"} = not sharded.
using DimAlias = std::vector<std::string>;
using AliasPlacements = std::vector<DimAlias>;

class Layout {
 public:
  Layout() = default;
  // One placement per mesh dim; multi-axis shards split in mesh-dim order.
  Layout(DeviceMeshPtr mesh, Placements placements);
  // A spec built elsewhere (validated against the mesh).
  Layout(DeviceMeshPtr mesh, ShardSpec spec);

  static Layout from_alias(DeviceMeshPtr mesh, const AliasPlacements& alias);
  static Layout from_tensor_map(DeviceMeshPtr mesh,
                                const std::vector<std::vector<int64_t>>& tensor_map);

  bool defined() const { return mesh_ != nullptr; }
  const DeviceMeshPtr& mesh() const { return mesh_; }
  const Placements& placements() const { return spec().placements; }
  const ShardSpec& spec() const { return spec_ ? *spec_ : empty_spec(); }
  // Mesh dims sharding `tensor_dim`, outermost first.
  std::vector<int64_t> mesh_dims_of(int64_t tensor_dim) const {
    return spec().mesh_dims_of(tensor_dim);
  }

  AliasPlacements alias_placements(int64_t tensor_ndim) const;
  std::vector<std::vector<int64_t>> tensor_map(int64_t tensor_ndim) const;
  // Ranks that hold identical data: the product of the Replicate dims' sizes.
  int64_t repeat_num() const;

  // The layout with negative shard dims resolved for a tensor of
  // `tensor_ndim` dims; shard dims out of range raise ArgumentError.
  Layout normalized(int64_t tensor_ndim) const;

  // Every mesh dim Replicate.
  static Layout replicated(DeviceMeshPtr mesh);
  // Operations on a layout. Each returns *this (sharing the spec, nothing
  // allocated) when nothing changes.
  // Every Partial placement replaced by Replicate.
  Layout without_partial() const;
  // Every placement that shards `tensor_dim` replaced by Replicate.
  Layout unshard_dim(int64_t tensor_dim) const;
  // Whether any placement is a StridedShard.
  bool has_strided() const;
  // Every StridedShard replaced by `as`: kReplicate for code that knows no
  // strided shards (the op rules that are not strided-aware), kPlainShard
  // for a box of the global tensor (a checkpoint's piece).
  enum class StridedAs { kReplicate, kPlainShard };
  Layout without_strided(StridedAs as) const;

  // This rank's local shape and global offset of a tensor of global `shape`
  // laid out as this layout (the rank's coordinate in the mesh).
  std::vector<int64_t> local_shape(const std::vector<int64_t>& shape) const;
  std::vector<int64_t> local_offset(const std::vector<int64_t>& shape) const;

  // "Layout(mesh ['dp', 'tp'] [2, 2], [S(0), R])".
  std::string str() const;

  // Same mesh (by value) and spec.
  bool operator==(const Layout& o) const;
  bool operator!=(const Layout& o) const { return !(*this == o); }

 private:
  static const ShardSpec& empty_spec();

  DeviceMeshPtr mesh_;
  // Immutable once built and shared by copies: every op on a DTensor copies
  // layouts (its inputs', its outputs'), which then allocates nothing.
  std::shared_ptr<const ShardSpec> spec_;
};

}  // namespace hp
