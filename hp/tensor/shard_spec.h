// ShardSpec: the mesh-independent part of a layout, and the chunk
// arithmetic that says which slice of a global tensor each rank holds.
//
// A tensor dim sharded over several mesh dims is split level by level, the
// outermost (slowest-varying) mesh dim first, each level with torch.chunk
// semantics: pieces of ceil(n / k) elements, the last ones smaller or empty.
// By default the levels follow mesh-dim order (as torch's DTensor does); the
// alias form may order them differently ("last name varies fastest"), which
// `orders` records for the tensor dims where it differs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "hp/tensor/placement.h"

namespace hp {

struct ShardSpec {
  Placements placements;                            // one per mesh dim
  std::map<int64_t, std::vector<int64_t>> orders;   // tensor dim -> mesh dims, outermost first

  // Mesh dims that shard `tensor_dim`, outermost first.
  std::vector<int64_t> mesh_dims_of(int64_t tensor_dim) const;
  // Drops orders that equal mesh-dim order (so equal specs compare equal).
  void canonicalize();
  // "[S(0), S(0)] order{0: [1, 0]}" (the order part only when present).
  std::string str() const;

  bool operator==(const ShardSpec& o) const {
    return placements == o.placements && orders == o.orders;
  }
  bool operator!=(const ShardSpec& o) const { return !(*this == o); }
};

struct Span {
  int64_t offset = 0;
  int64_t size = 0;
};

// Piece `index` of `length` elements split into `pieces` by torch.chunk.
Span chunk_span(int64_t length, int64_t pieces, int64_t index);

// The span of `tensor_dim` held at `coordinate` of a mesh of `mesh_shape`.
Span shard_span(int64_t length, const ShardSpec& spec, int64_t tensor_dim,
                const std::vector<int64_t>& mesh_shape, const std::vector<int64_t>& coordinate);

// Local shape and global offset of the shard held at `coordinate`.
std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape, const ShardSpec& spec,
                                 const std::vector<int64_t>& mesh_shape,
                                 const std::vector<int64_t>& coordinate);
std::vector<int64_t> local_offset(const std::vector<int64_t>& global_shape, const ShardSpec& spec,
                                  const std::vector<int64_t>& mesh_shape,
                                  const std::vector<int64_t>& coordinate);

}  // namespace hp
