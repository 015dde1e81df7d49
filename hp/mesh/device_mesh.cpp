#include "hp/mesh/device_mesh.h"

#include <ATen/Context.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <set>

#include "hp/distributed/world.h"
#include "hp/util/env.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp {
namespace {

// Row-major strides of a shape.
std::vector<int64_t> strides_of(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * shape[d + 1];
  }
  return strides;
}

// Calls fn(ranks) for each slice of the mesh along the dims in `dims` (the
// other dims fixed), slices in row-major order of the other dims and ranks
// in row-major order of `dims`. Every process enumerates the same sequence,
// which is what makes group creation collective.
template <typename Fn>
void for_each_slice(const std::vector<int64_t>& shape, const std::vector<int>& ranks,
                    const std::vector<int64_t>& dims, Fn&& fn) {
  const auto strides = strides_of(shape);
  std::vector<int64_t> other;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    if (std::find(dims.begin(), dims.end(), d) == dims.end()) other.push_back(d);
  }
  auto count = [&](const std::vector<int64_t>& ds) {
    int64_t n = 1;
    for (int64_t d : ds) n *= shape[d];
    return n;
  };
  // Offset of the i-th combination of `ds` in row-major order.
  auto offset_of = [&](const std::vector<int64_t>& ds, int64_t i) {
    int64_t offset = 0;
    for (int64_t k = static_cast<int64_t>(ds.size()) - 1; k >= 0; --k) {
      offset += (i % shape[ds[k]]) * strides[ds[k]];
      i /= shape[ds[k]];
    }
    return offset;
  };
  const int64_t slices = count(other), members = count(dims);
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t base = offset_of(other, s);
    std::vector<int> slice;
    slice.reserve(members);
    for (int64_t m = 0; m < members; ++m) slice.push_back(ranks[base + offset_of(dims, m)]);
    fn(slice);
  }
}

void check_device_type(const std::string& device_type) {
  HP_CHECK_ARG(device_type == "cpu" || device_type == "cuda",
               "device_type must be 'cpu' or 'cuda', got '", device_type, "'");
  if (device_type == "cuda") compat::require_cuda("device_type 'cuda'");
}

// The backend of a 'cuda' mesh's groups: HP_CUDA_BACKEND=nccl|gloo, by
// default NCCL where this libtorch has it. Gloo carries CUDA tensors through
// host copies, and lets ranks share one GPU, which NCCL refuses.
dist::BackendType cuda_backend() {
  const std::optional<std::string> value =
      hp::env::get_choice("HP_CUDA_BACKEND", {"nccl", "gloo"});
  if (!value) return compat::has_nccl() ? dist::BackendType::kNccl : dist::BackendType::kGloo;
  const std::string& name = *value;
  HP_CHECK_ARG(name == "gloo" || compat::has_nccl(), "HP_CUDA_BACKEND=nccl needs a libtorch "
               "built with NCCL; this libtorch ", compat::torch_version(), " has none: use "
               "HP_CUDA_BACKEND=gloo");
  return name == "nccl" ? dist::BackendType::kNccl : dist::BackendType::kGloo;
}

}  // namespace

DeviceMeshPtr DeviceMesh::create(const std::string& device_type, std::vector<int64_t> shape,
                                 std::vector<int> ranks, std::vector<std::string> names) {
  check_device_type(device_type);
  HP_CHECK_ARG(!shape.empty(), "mesh shape must have at least one dim, got []");
  int64_t product = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    HP_CHECK_ARG(shape[d] > 0, "mesh shape ", to_string(shape), ": dim ", d, " has size ",
                 shape[d], ", expected a positive size");
    product *= shape[d];
  }
  HP_CHECK_ARG(static_cast<int64_t>(ranks.size()) == product, "mesh shape ", to_string(shape),
               " holds ", product, " ranks but ", ranks.size(), " ranks were given");
  const int world = dist::get_world_size();
  std::set<int> seen;
  for (int r : ranks) {
    HP_CHECK_ARG(r >= 0 && r < world, "mesh rank ", r, " is out of range for world size ",
                 world);
    HP_CHECK_ARG(seen.insert(r).second, "mesh ranks ", to_string(ranks), " contain rank ", r,
                 " twice");
  }
  if (names.empty()) {
    for (size_t d = 0; d < shape.size(); ++d) names.push_back(cat("dim_", d));
  }
  HP_CHECK_ARG(names.size() == shape.size(), "mesh dim names ", to_string(names), " has ",
               names.size(), " entries but the mesh shape ", to_string(shape), " has ",
               shape.size(), " dims");
  std::set<std::string> unique;
  for (const auto& name : names) {
    HP_CHECK_ARG(!name.empty() && name != "None",
                 "mesh dim names ", to_string(names), " contain '", name,
                 "'; expected a non-empty name other than 'None' (reserved by the alias form)");
    HP_CHECK_ARG(unique.insert(name).second, "mesh dim names ", to_string(names),
                 " contain '", name, "' twice; expected unique names");
  }

  dist::BackendType backend = dist::BackendType::kGloo;
  c10::Device device(c10::DeviceType::CPU);
  if (device_type == "cuda") {
    backend = cuda_backend();
    device = dist::local_cuda_device();
  }

  std::shared_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->device_type_ = device_type;
  mesh->device_ = device;
  mesh->backend_ = backend;
  mesh->shape_ = std::move(shape);
  mesh->ranks_ = std::move(ranks);
  mesh->names_ = std::move(names);
  for (int64_t d = 0; d < mesh->ndim(); ++d) mesh->dims_in_root_.push_back(d);
  const int me = dist::get_rank();
  auto it = std::find(mesh->ranks_.begin(), mesh->ranks_.end(), me);
  if (it != mesh->ranks_.end()) {
    int64_t index = it - mesh->ranks_.begin();
    mesh->coordinate_.resize(mesh->shape_.size());
    for (int64_t d = mesh->ndim() - 1; d >= 0; --d) {
      mesh->coordinate_[d] = index % mesh->shape_[d];
      index /= mesh->shape_[d];
    }
  }
  mesh->make_groups();
  return mesh;
}

dist::GroupOptions DeviceMesh::group_options() const {
  dist::GroupOptions options;
  options.backend = backend_;
  return options;
}

void DeviceMesh::make_groups() {
  groups_.assign(shape_.size(), nullptr);
  const int me = dist::get_rank();
  for (int64_t d = 0; d < ndim(); ++d) {
    for_each_slice(shape_, ranks_, {d}, [&](const std::vector<int>& slice) {
      dist::GroupPtr group = dist::new_group(slice, group_options());
      if (std::find(slice.begin(), slice.end(), me) != slice.end()) groups_[d] = group;
    });
  }
}

int64_t DeviceMesh::checked_dim(int64_t dim) const {
  HP_CHECK_ARG(dim >= -ndim() && dim < ndim(), "mesh dim ", dim, " is out of range for ",
               describe(), "; expected -", ndim(), " <= dim < ", ndim());
  return dim < 0 ? dim + ndim() : dim;
}

int64_t DeviceMesh::size(int64_t dim) const { return shape_[checked_dim(dim)]; }

int64_t DeviceMesh::dim_index(const std::string& name) const {
  for (size_t d = 0; d < names_.size(); ++d) {
    if (names_[d] == name) return static_cast<int64_t>(d);
  }
  throw_argument_error(cat("mesh dim name '", name, "' is not one of the mesh's dims ",
                           to_string(names_)));
}

const std::vector<int64_t>& DeviceMesh::coordinate() const {
  HP_CHECK_ARG(contains_self(), "rank ", dist::get_rank(), " is not part of ", describe());
  return coordinate_;
}

int DeviceMesh::rank_at(const std::vector<int64_t>& coordinate) const {
  HP_CHECK_ARG(coordinate.size() == shape_.size(), "coordinate ", to_string(coordinate),
               " has ", coordinate.size(), " entries but the mesh has ", ndim(), " dims");
  int64_t index = 0;
  for (size_t d = 0; d < shape_.size(); ++d) {
    HP_CHECK_ARG(coordinate[d] >= 0 && coordinate[d] < shape_[d], "coordinate ",
                 to_string(coordinate), " is outside mesh shape ", to_string(shape_));
    index = index * shape_[d] + coordinate[d];
  }
  return ranks_[index];
}

dist::Group& DeviceMesh::group(int64_t dim) const { return *group_ptr(dim); }

dist::GroupPtr DeviceMesh::group_ptr(int64_t dim) const {
  dim = checked_dim(dim);
  HP_CHECK_ARG(groups_[dim] != nullptr, "rank ", dist::get_rank(), " is not part of ",
               describe(), ", so it has no group along dim '", names_[dim], "'");
  return groups_[dim];
}

std::vector<int64_t> DeviceMesh::dims_of(const std::vector<std::string>& names,
                                         const char* what) const {
  HP_CHECK_ARG(!names.empty(), what, " must not be empty; expected some of ", to_string(names_));
  std::vector<int64_t> dims;
  for (const auto& name : names) {
    int64_t d = dim_index(name);
    HP_CHECK_ARG(dims.empty() || d > dims.back(), what, " ", to_string(names),
                 " must be distinct and in the mesh's order ", to_string(names_));
    dims.push_back(d);
  }
  return dims;
}

DeviceMeshPtr DeviceMesh::sub(const std::vector<std::string>& names) const {
  const std::vector<int64_t> dims = dims_of(names, "sub-mesh names");
  const auto& coord = coordinate();
  std::shared_ptr<DeviceMesh> sub(new DeviceMesh());
  sub->device_type_ = device_type_;
  sub->device_ = device_;
  sub->backend_ = backend_;
  for (int64_t d : dims) {
    sub->shape_.push_back(shape_[d]);
    sub->names_.push_back(names_[d]);
    sub->coordinate_.push_back(coord[d]);
    sub->groups_.push_back(groups_[d]);
    sub->dims_in_root_.push_back(dims_in_root_[d]);
  }
  sub->root_ = root();
  // Ranks of the slice through this rank's coordinate.
  std::vector<int64_t> c = coord;
  int64_t total = 1;
  for (int64_t d : dims) total *= shape_[d];
  for (int64_t i = 0; i < total; ++i) {
    int64_t rest = i;
    for (int64_t k = static_cast<int64_t>(dims.size()) - 1; k >= 0; --k) {
      c[dims[k]] = rest % shape_[dims[k]];
      rest /= shape_[dims[k]];
    }
    sub->ranks_.push_back(rank_at(c));
  }
  return sub;
}

DeviceMeshPtr DeviceMesh::flatten(const std::vector<std::string>& names,
                                  std::string new_name) const {
  const std::vector<int64_t> dims = dims_of(names, "flatten: names");
  if (new_name.empty()) {
    for (size_t i = 0; i < names.size(); ++i) new_name += (i ? "_" : "") + names[i];
  }
  HP_CHECK_ARG(new_name != "None", "flatten: new_name 'None' is reserved by the alias form");
  const int me = dist::get_rank();
  std::shared_ptr<DeviceMesh> flat(new DeviceMesh());
  flat->device_type_ = device_type_;
  flat->device_ = device_;
  flat->backend_ = backend_;
  int64_t size = 1;
  for (int64_t d : dims) size *= shape_[d];
  flat->shape_ = {size};
  flat->names_ = {new_name};
  flat->dims_in_root_ = {0};
  dist::GroupPtr mine;
  for_each_slice(shape_, ranks_, dims, [&](const std::vector<int>& slice) {
    dist::GroupPtr group = dist::new_group(slice, group_options());
    auto it = std::find(slice.begin(), slice.end(), me);
    if (it != slice.end()) {
      mine = group;
      flat->ranks_ = slice;
      flat->coordinate_ = {static_cast<int64_t>(it - slice.begin())};
    }
  });
  HP_CHECK_ARG(mine != nullptr, "rank ", me, " is not part of ", describe());
  flat->groups_ = {mine};
  return flat;
}

std::string DeviceMesh::describe() const {
  return cat("DeviceMesh('", device_type_, "', shape ", to_string(shape_), ", ranks ",
             to_string(ranks_), ", dims ", to_string(names_), ")");
}

DeviceMeshPtr DeviceMesh::root() const { return root_ ? root_ : shared_from_this(); }

bool DeviceMesh::operator==(const DeviceMesh& other) const {
  return device_type_ == other.device_type_ && shape_ == other.shape_ &&
         ranks_ == other.ranks_ && names_ == other.names_;
}

DeviceMeshPtr init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                               const std::vector<std::string>& names) {
  check_device_type(device_type);
  HP_CHECK_ARG(!shape.empty(), "init_device_mesh: mesh shape must have at least one dim, got []");
  int64_t product = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    HP_CHECK_ARG(shape[d] > 0, "init_device_mesh: mesh shape ", to_string(shape), ": dim ", d,
                 " has size ", shape[d], ", expected a positive size");
    product *= shape[d];
  }
  const int world = dist::get_world_size();
  HP_CHECK_ARG(product == world, "init_device_mesh: mesh shape ", to_string(shape), " holds ",
               product, " ranks but the world size is ", world,
               "; expected the product of the shape to equal the world size");
  std::vector<int> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r] = r;
  return DeviceMesh::create(device_type, shape, std::move(ranks), names);
}

}  // namespace hp
