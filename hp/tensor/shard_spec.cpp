#include "hp/tensor/shard_spec.h"

#include <algorithm>

#include "hp/util/format.h"

namespace hp {

std::vector<int64_t> ShardSpec::mesh_dims_of(int64_t tensor_dim) const {
  auto it = orders.find(tensor_dim);
  if (it != orders.end()) return it->second;
  std::vector<int64_t> dims;
  for (size_t m = 0; m < placements.size(); ++m) {
    if (placements[m].is_shard(tensor_dim)) dims.push_back(static_cast<int64_t>(m));
  }
  return dims;
}

void ShardSpec::canonicalize() {
  for (auto it = orders.begin(); it != orders.end();) {
    bool ascending = std::is_sorted(it->second.begin(), it->second.end());
    it = ascending ? orders.erase(it) : std::next(it);
  }
}

std::string ShardSpec::str() const {
  std::string out = to_string(placements);
  if (!orders.empty()) {
    out += " order{";
    bool first = true;
    for (const auto& [dim, mesh_dims] : orders) {
      out += cat(first ? "" : ", ", dim, ": ", to_string(mesh_dims));
      first = false;
    }
    out += "}";
  }
  return out;
}

Span chunk_span(int64_t length, int64_t pieces, int64_t index) {
  const int64_t chunk = (length + pieces - 1) / pieces;
  const int64_t begin = std::min(length, chunk * index);
  const int64_t end = std::min(length, chunk * (index + 1));
  return {begin, end - begin};
}

Span shard_span(int64_t length, const ShardSpec& spec, int64_t tensor_dim,
                const std::vector<int64_t>& mesh_shape, const std::vector<int64_t>& coordinate) {
  // A strided shard holds its piece of each of k blocks: the size is k
  // pieces, the offset that of the piece in the first block.
  for (size_t m = 0; m < spec.placements.size(); ++m) {
    const Placement& p = spec.placements[m];
    if (!p.is_strided_shard(tensor_dim)) continue;
    const int64_t k = p.split_factor();
    Span piece = chunk_span(length / k, mesh_shape[m], coordinate[m]);
    return {piece.offset, k * piece.size};
  }
  // Level by level, outermost first (mesh_dims_of's order, without its
  // vector: this runs for every dim of every op on a DTensor).
  Span span{0, length};
  auto split = [&](int64_t m) {
    Span piece = chunk_span(span.size, mesh_shape[m], coordinate[m]);
    span = {span.offset + piece.offset, piece.size};
  };
  auto order = spec.orders.find(tensor_dim);
  if (order != spec.orders.end()) {
    for (int64_t m : order->second) split(m);
  } else {
    for (size_t m = 0; m < spec.placements.size(); ++m) {
      if (spec.placements[m].is_shard(tensor_dim)) split(static_cast<int64_t>(m));
    }
  }
  return span;
}

namespace {

// One field of the span of every tensor dim held at `coordinate`.
std::vector<int64_t> span_field(const std::vector<int64_t>& global_shape, const ShardSpec& spec,
                                const std::vector<int64_t>& mesh_shape,
                                const std::vector<int64_t>& coordinate, int64_t Span::*field) {
  std::vector<int64_t> out(global_shape.size());
  for (size_t d = 0; d < global_shape.size(); ++d) {
    out[d] = shard_span(global_shape[d], spec, d, mesh_shape, coordinate).*field;
  }
  return out;
}

}  // namespace

std::vector<int64_t> local_shape(const std::vector<int64_t>& global_shape, const ShardSpec& spec,
                                 const std::vector<int64_t>& mesh_shape,
                                 const std::vector<int64_t>& coordinate) {
  return span_field(global_shape, spec, mesh_shape, coordinate, &Span::size);
}

std::vector<int64_t> local_offset(const std::vector<int64_t>& global_shape, const ShardSpec& spec,
                                  const std::vector<int64_t>& mesh_shape,
                                  const std::vector<int64_t>& coordinate) {
  return span_field(global_shape, spec, mesh_shape, coordinate, &Span::offset);
}

}  // namespace hp
