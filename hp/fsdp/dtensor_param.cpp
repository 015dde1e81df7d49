#include "hp/fsdp/dtensor_param.h"

#include <algorithm>

#include "hp/util/error.h"

namespace hp::fsdp {
namespace {

bool contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

void check_composable(const std::string& fqn, const Layout& param_layout,
                      const DeviceMesh& fsdp_mesh) {
  const DeviceMesh& mesh = *param_layout.mesh();
  HP_CHECK_ARG(*mesh.root() == *fsdp_mesh.root(), "fully_shard: parameter '", fqn,
               "' is a DTensor on ", mesh.describe(), ", which is not a sub-mesh of the mesh ",
               "fully_shard's ", fsdp_mesh.describe(), " was taken from (",
               fsdp_mesh.root()->describe(), "); build both from one init_device_mesh, e.g. ",
               "mesh[\"tp\"] for tensor parallelism and mesh[\"dp\"] for fully_shard");
  const auto& fsdp_dims = fsdp_mesh.dims_in_root();
  for (int64_t m = 0; m < mesh.ndim(); ++m) {
    if (!contains(fsdp_dims, mesh.dims_in_root()[m])) continue;
    HP_CHECK_ARG(param_layout.placements()[m].is_replicate(), "fully_shard: parameter '", fqn,
                 "' is already ", param_layout.placements()[m].str(), " over mesh dim '",
                 mesh.dim_names()[m], "', which fully_shard's mesh ", fsdp_mesh.describe(),
                 " shards over; expected Replicate there");
  }
}

std::optional<int64_t> default_shard_dim(const Layout& param_layout,
                                         const std::vector<int64_t>& local_shape,
                                         int64_t shard_size) {
  const int64_t ndim = static_cast<int64_t>(local_shape.size());
  for (int64_t d = 0; d < ndim; ++d) {
    bool taken = false;
    for (const Placement& p : param_layout.placements()) taken |= p.is_sharded() && p.dim() == d;
    if (taken) continue;
    if (d == 0 || local_shape[d] % shard_size == 0) return d;
  }
  return std::nullopt;
}

Layout shard_layout(const MeshInfo& mesh, const Layout* param_layout, int64_t tensor_ndim,
                    std::optional<int64_t> shard_dim) {
  const Placements fsdp = shard_dim ? mesh.placements(*shard_dim) : mesh.replicated_placements();
  if (!param_layout) return Layout(mesh.mesh, fsdp);
  const Layout own = param_layout->normalized(tensor_ndim);
  const DeviceMesh& param_mesh = *own.mesh();
  const auto& fsdp_dims = mesh.mesh->dims_in_root();
  const auto& param_dims = param_mesh.dims_in_root();
  std::vector<int64_t> dims = fsdp_dims;
  for (int64_t d : param_dims) {
    if (!contains(dims, d)) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end());
  DeviceMeshPtr root = mesh.mesh->root();
  std::vector<std::string> names;
  for (int64_t d : dims) names.push_back(root->dim_names()[d]);
  DeviceMeshPtr combined = root->sub(names);

  // Where each of the two meshes' dims sits in the combined one.
  auto index_in_combined = [&](int64_t root_dim) {
    return static_cast<int64_t>(std::find(dims.begin(), dims.end(), root_dim) - dims.begin());
  };
  ShardSpec spec;
  spec.placements.assign(dims.size(), Replicate());
  for (int64_t m = 0; m < param_mesh.ndim(); ++m) {
    spec.placements[index_in_combined(param_dims[m])] = own.placements()[m];
  }
  for (size_t m = 0; m < fsdp_dims.size(); ++m) {
    spec.placements[index_in_combined(fsdp_dims[m])] = fsdp[m];
  }
  for (const auto& [tensor_dim, order] : own.spec().orders) {
    std::vector<int64_t> mapped;
    for (int64_t m : order) mapped.push_back(index_in_combined(param_dims[m]));
    spec.orders[tensor_dim] = mapped;
  }
  return Layout(combined, spec);
}

}  // namespace hp::fsdp
