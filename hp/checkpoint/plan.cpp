#include "hp/checkpoint/plan.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace hp::checkpoint {
namespace {

Box box_at(const StateEntry& entry, const std::vector<int64_t>& coordinate) {
  const DeviceMesh& mesh = *entry.layout.mesh();
  const ShardSpec& spec = entry.layout.spec();
  return {local_offset(entry.shape, spec, mesh.shape(), coordinate),
          local_shape(entry.shape, spec, mesh.shape(), coordinate)};
}

}  // namespace

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  Box out;
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    const int64_t begin = std::max(a.offsets[d], b.offsets[d]);
    const int64_t end = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (end <= begin) return std::nullopt;
    out.offsets.push_back(begin);
    out.sizes.push_back(end - begin);
  }
  return out;
}

Box local_box(const StateEntry& entry) {
  if (!entry.held_here) return {std::vector<int64_t>(entry.shape.size(), 0),
                                std::vector<int64_t>(entry.shape.size(), 0)};
  if (!entry.layout.defined()) return {std::vector<int64_t>(entry.shape.size(), 0), entry.shape};
  return box_at(entry, entry.layout.mesh()->coordinate());
}

std::vector<PlannedChunk> plan_chunks(const StateEntry& entry) {
  std::vector<PlannedChunk> chunks;
  if (!entry.layout.defined()) {
    Box whole{std::vector<int64_t>(entry.shape.size(), 0), entry.shape};
    // Every rank of the job, or of the holders, holds it whole: the lowest writes it.
    const int writer = entry.holders.empty() ? 0 : entry.holders.front();
    if (whole.numel() > 0) chunks.push_back({whole, writer});
    return chunks;
  }
  const DeviceMesh& mesh = *entry.layout.mesh();
  const std::vector<int64_t>& shape = mesh.shape();
  std::vector<int64_t> coordinate(shape.size(), 0);
  for (int64_t index = 0; index < mesh.size(); ++index) {
    // Row-major: the mesh's index-th rank sits at `coordinate`.
    int64_t rest = index;
    for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
      coordinate[d] = rest % shape[d];
      rest /= shape[d];
    }
    Box box = box_at(entry, coordinate);
    if (box.numel() == 0) continue;
    const int rank = mesh.ranks()[static_cast<size_t>(index)];
    auto same = std::find_if(chunks.begin(), chunks.end(),
                             [&](const PlannedChunk& c) { return c.box == box; });
    if (same == chunks.end()) {
      chunks.push_back({std::move(box), rank});
    } else {
      same->writer = std::min(same->writer, rank);
    }
  }
  return chunks;
}

at::Tensor view_of(const at::Tensor& data, const Box& box, const Box& part) {
  at::Tensor view = data;
  for (size_t d = 0; d < box.offsets.size(); ++d) {
    view = view.narrow(static_cast<int64_t>(d), part.offsets[d] - box.offsets[d], part.sizes[d]);
  }
  return view;
}

}  // namespace hp::checkpoint
