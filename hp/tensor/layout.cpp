#include "hp/tensor/layout.h"

#include <algorithm>
#include <set>

#include "hp/util/error.h"

namespace hp {
namespace {

bool is_unsharded(const DimAlias& entry) {
  return entry.empty() || (entry.size() == 1 && entry[0] == "None");
}

// `layout` with `replace` (true when it changed its placement) applied to
// every placement; the layout itself (its spec shared) when none changed.
// A shard order keeps only the mesh dims that still shard its tensor dim.
template <typename Replace>
Layout with_replaced(const Layout& layout, Replace&& replace) {
  ShardSpec spec = layout.spec();
  bool changed = false;
  for (auto& p : spec.placements) changed |= replace(p);
  if (!changed) return layout;
  for (auto& [dim, order] : spec.orders) {
    const int64_t tensor_dim = dim;
    order.erase(std::remove_if(order.begin(), order.end(),
                               [&](int64_t m) { return !spec.placements[m].is_shard(tensor_dim); }),
                order.end());
  }
  return Layout(layout.mesh(), std::move(spec));
}

}  // namespace

Layout::Layout(DeviceMeshPtr mesh, Placements placements)
    : Layout(std::move(mesh), ShardSpec{std::move(placements), {}}) {}

const ShardSpec& Layout::empty_spec() {
  static const ShardSpec* empty = new ShardSpec();
  return *empty;
}

Layout::Layout(DeviceMeshPtr mesh, ShardSpec spec) : mesh_(std::move(mesh)) {
  HP_CHECK_ARG(mesh_ != nullptr, "Layout: mesh must not be null");
  HP_CHECK_ARG(static_cast<int64_t>(spec.placements.size()) == mesh_->ndim(), "Layout: ",
               spec.placements.size(), " placements ", to_string(spec.placements),
               " given for a ", mesh_->ndim(), "-d mesh ", to_string(mesh_->dim_names()),
               "; expected one placement per mesh dim");
  for (const auto& [dim, mesh_dims] : spec.orders) {
    std::vector<int64_t> expected;
    for (int64_t m = 0; m < mesh_->ndim(); ++m) {
      if (spec.placements[m].is_shard(dim)) expected.push_back(m);
    }
    std::vector<int64_t> sorted = mesh_dims;
    std::sort(sorted.begin(), sorted.end());
    HP_CHECK_ARG(sorted == expected, "Layout: shard order ", to_string(mesh_dims),
                 " of tensor dim ", dim, " must list exactly the mesh dims ",
                 to_string(expected), " that shard it under ", to_string(spec.placements));
  }
  for (int64_t m = 0; m < mesh_->ndim(); ++m) {
    const Placement& p = spec.placements[m];
    if (!p.is_strided_shard()) continue;
    HP_CHECK_ARG(p.split_factor() >= 2, "Layout: ", p.str(), " on mesh dim '",
                 mesh_->dim_names()[m], "' needs a split factor of at least 2");
    for (int64_t o = 0; o < mesh_->ndim(); ++o) {
      const Placement& q = spec.placements[o];
      HP_CHECK_ARG(o == m || !q.is_sharded() || q.dim() != p.dim(), "Layout: ", p.str(),
                   " on mesh dim '", mesh_->dim_names()[m], "' and ", q.str(), " on mesh dim '",
                   mesh_->dim_names()[o], "' shard the same tensor dim; a strided shard must be ",
                   "the only one on its dim");
    }
  }
  spec.canonicalize();
  spec_ = std::make_shared<const ShardSpec>(std::move(spec));
}

Layout Layout::from_alias(DeviceMeshPtr mesh, const AliasPlacements& alias) {
  HP_CHECK_ARG(mesh != nullptr, "Layout::from_alias: mesh must not be null");
  Placements placements(mesh->ndim(), Replicate());
  std::vector<int64_t> used_by(mesh->ndim(), -1);
  ShardSpec spec;
  for (size_t d = 0; d < alias.size(); ++d) {
    if (is_unsharded(alias[d])) continue;
    std::vector<int64_t> order;
    for (const auto& name : alias[d]) {
      HP_CHECK_ARG(name != "None", "alias placements: tensor dim ", d, " mixes 'None' with mesh ",
                   "dim names ", to_string(alias[d]), "; expected 'None' alone");
      int64_t m = mesh->dim_index(name);
      HP_CHECK_ARG(used_by[m] < 0, "alias placements: mesh dim '", name, "' shards tensor dim ",
                   used_by[m], " and tensor dim ", d, "; a mesh dim can shard one tensor dim");
      used_by[m] = static_cast<int64_t>(d);
      placements[m] = Shard(static_cast<int64_t>(d));
      order.push_back(m);
    }
    spec.orders[static_cast<int64_t>(d)] = order;
  }
  spec.placements = std::move(placements);
  return Layout(std::move(mesh), std::move(spec));
}

Layout Layout::from_tensor_map(DeviceMeshPtr mesh,
                               const std::vector<std::vector<int64_t>>& tensor_map) {
  HP_CHECK_ARG(mesh != nullptr, "Layout::from_tensor_map: mesh must not be null");
  AliasPlacements alias;
  for (size_t d = 0; d < tensor_map.size(); ++d) {
    DimAlias entry;
    for (int64_t v : tensor_map[d]) {
      if (v == -1 && tensor_map[d].size() == 1) break;
      HP_CHECK_ARG(v >= 0 && v < mesh->ndim(), "tensor_map entry ", v, " of tensor dim ", d,
                   " is out of range for a ", mesh->ndim(), "-d mesh; expected -1 or 0..",
                   mesh->ndim() - 1);
      entry.push_back(mesh->dim_names()[mesh->ndim() - 1 - v]);
    }
    alias.push_back(entry);
  }
  return from_alias(std::move(mesh), alias);
}

AliasPlacements Layout::alias_placements(int64_t tensor_ndim) const {
  for (int64_t m = 0; m < mesh_->ndim(); ++m) {
    HP_CHECK_ARG(!spec().placements[m].is_partial(), "the alias form cannot express ",
                 spec().placements[m].str(), " on mesh dim '", mesh_->dim_names()[m], "' of ",
                 str());
  }
  Layout norm = normalized(tensor_ndim);
  AliasPlacements alias;
  for (int64_t d = 0; d < tensor_ndim; ++d) {
    DimAlias entry;
    for (int64_t m : norm.mesh_dims_of(d)) entry.push_back(mesh_->dim_names()[m]);
    if (entry.empty()) entry.push_back("None");
    alias.push_back(entry);
  }
  return alias;
}

std::vector<std::vector<int64_t>> Layout::tensor_map(int64_t tensor_ndim) const {
  AliasPlacements alias = alias_placements(tensor_ndim);
  std::vector<std::vector<int64_t>> map;
  for (const auto& entry : alias) {
    std::vector<int64_t> values;
    if (is_unsharded(entry)) {
      values.push_back(-1);
    } else {
      for (const auto& name : entry) values.push_back(mesh_->ndim() - 1 - mesh_->dim_index(name));
    }
    map.push_back(values);
  }
  return map;
}

int64_t Layout::repeat_num() const {
  int64_t n = 1;
  for (int64_t m = 0; m < mesh_->ndim(); ++m) {
    if (spec().placements[m].is_replicate()) n *= mesh_->size(m);
  }
  return n;
}

Layout Layout::normalized(int64_t tensor_ndim) const {
  const ShardSpec& own = this->spec();
  const bool resolved =
      std::all_of(own.placements.begin(), own.placements.end(),
                  [&](const Placement& p) {
                    return !p.is_sharded() || (p.dim() >= 0 && p.dim() < tensor_ndim);
                  }) &&
      std::all_of(own.orders.begin(), own.orders.end(),
                  [](const auto& entry) { return entry.first >= 0; });
  if (resolved) return *this;  // shares the spec: nothing to allocate
  ShardSpec spec;
  for (int64_t m = 0; m < static_cast<int64_t>(own.placements.size()); ++m) {
    const Placement& p = own.placements[m];
    if (!p.is_sharded()) {
      spec.placements.push_back(p);
      continue;
    }
    HP_CHECK_ARG(p.dim() >= -tensor_ndim && p.dim() < tensor_ndim, p.str(), " on mesh dim '",
                 mesh_->dim_names()[m], "' is out of range for a tensor with ", tensor_ndim,
                 " dims; expected -", tensor_ndim, " <= dim < ", tensor_ndim);
    spec.placements.push_back(p.with_dim(p.dim() < 0 ? p.dim() + tensor_ndim : p.dim()));
  }
  for (const auto& [dim, order] : own.orders) {
    spec.orders[dim < 0 ? dim + tensor_ndim : dim] = order;
  }
  return Layout(mesh_, std::move(spec));
}

Layout Layout::replicated(DeviceMeshPtr mesh) {
  HP_CHECK_ARG(mesh != nullptr, "Layout::replicated: mesh must not be null");
  const int64_t ndim = mesh->ndim();
  return Layout(std::move(mesh), Placements(ndim, Replicate()));
}

Layout Layout::without_partial() const {
  return with_replaced(*this, [](Placement& p) {
    if (!p.is_partial()) return false;
    p = Replicate();
    return true;
  });
}

Layout Layout::unshard_dim(int64_t tensor_dim) const {
  return with_replaced(*this, [tensor_dim](Placement& p) {
    if (!p.is_sharded() || p.dim() != tensor_dim) return false;
    p = Replicate();
    return true;
  });
}

bool Layout::has_strided() const {
  const Placements& own = placements();
  return std::any_of(own.begin(), own.end(),
                     [](const Placement& p) { return p.is_strided_shard(); });
}

Layout Layout::without_strided(StridedAs as) const {
  return with_replaced(*this, [as](Placement& p) {
    if (!p.is_strided_shard()) return false;
    p = as == StridedAs::kReplicate ? Replicate() : Shard(p.dim());
    return true;
  });
}

std::vector<int64_t> Layout::local_shape(const std::vector<int64_t>& shape) const {
  return hp::local_shape(shape, spec(), mesh_->shape(), mesh_->coordinate());
}

std::vector<int64_t> Layout::local_offset(const std::vector<int64_t>& shape) const {
  return hp::local_offset(shape, spec(), mesh_->shape(), mesh_->coordinate());
}

std::string Layout::str() const {
  if (!mesh_) return "Layout(undefined)";
  return cat("Layout(mesh ", to_string(mesh_->dim_names()), " ", to_string(mesh_->shape()), ", ",
             spec().str(), ")");
}

bool Layout::operator==(const Layout& o) const {
  if (spec_ != o.spec_ && spec() != o.spec()) return false;
  if (mesh_ == o.mesh_) return true;
  return mesh_ && o.mesh_ && *mesh_ == *o.mesh_;
}

}  // namespace hp
