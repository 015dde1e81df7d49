// DeviceMesh: an N-d arrangement of global ranks with named dims and one
// process group per dim (M1-M3 in docs/features.md).
//
// Ranks are laid out row-major: for shape [2, 3] rank 4 sits at (1, 1).
// Building a mesh is collective over the whole world, as in
// torch.distributed: every rank calls init_device_mesh with the same
// arguments, and each mesh dim gets one group per slice, of which this rank
// keeps the one it belongs to. Sub-meshes (mesh["dp"], mesh.sub({"dp",
// "tp"})) are local: they reuse the parent's groups. flatten() merges dims
// into one group and is collective again.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "hp/distributed/group.h"
#include "hp/distributed/world.h"

namespace hp {

class DeviceMesh;
using DeviceMeshPtr = std::shared_ptr<const DeviceMesh>;

class DeviceMesh : public std::enable_shared_from_this<DeviceMesh> {
 public:
  // Collective. `ranks` lists the mesh's global ranks row-major (its size is
  // the product of `shape`); `names` may be empty for default names "dim_<i>".
  static DeviceMeshPtr create(const std::string& device_type, std::vector<int64_t> shape,
                              std::vector<int> ranks, std::vector<std::string> names = {});

  const std::string& device_type() const { return device_type_; }
  // Where this rank's tensors live: cpu, or for 'cuda' its GPU (the
  // LOCAL_RANK-th, hp::dist::local_cuda_index; made the current device when
  // the mesh was built).
  c10::Device device() const { return device_; }
  // The backend of the mesh's groups: Gloo for 'cpu'; for 'cuda' NCCL, or
  // Gloo when HP_CUDA_BACKEND=gloo (ranks sharing one GPU).
  dist::BackendType backend_type() const { return backend_; }
  int64_t ndim() const { return static_cast<int64_t>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t size() const { return static_cast<int64_t>(ranks_.size()); }
  int64_t size(int64_t dim) const;
  int64_t size(const std::string& name) const { return size(dim_index(name)); }
  const std::vector<std::string>& dim_names() const { return names_; }
  // Index of a named dim; unknown names raise ArgumentError listing the names.
  int64_t dim_index(const std::string& name) const;

  // Global ranks, row-major.
  const std::vector<int>& ranks() const { return ranks_; }
  // Whether this process is one of the mesh's ranks.
  bool contains_self() const { return !coordinate_.empty(); }
  // This rank's coordinate (one entry per dim); raises if not in the mesh.
  const std::vector<int64_t>& coordinate() const;
  int64_t coordinate(int64_t dim) const { return coordinate().at(checked_dim(dim)); }
  // Global rank at a coordinate.
  int rank_at(const std::vector<int64_t>& coordinate) const;

  // The group along `dim` that contains this rank.
  dist::Group& group(int64_t dim) const;
  dist::Group& group(const std::string& name) const { return group(dim_index(name)); }
  dist::GroupPtr group_ptr(int64_t dim) const;

  // The sub-mesh over the named dims (in mesh order) through this rank:
  // mesh["tp"], mesh[{"dp", "tp"}] (M2). The list overload is what a
  // braced list picks (it is preferred over building one std::string from
  // {"dp", "tp"}, which would read the two literals as an iterator range).
  DeviceMeshPtr operator[](const std::string& name) const { return sub({name}); }
  DeviceMeshPtr operator[](std::initializer_list<std::string> names) const { return sub(names); }
  DeviceMeshPtr sub(const std::vector<std::string>& names) const;
  // The mesh this one was taken from by sub() (through any chain of them),
  // or the mesh itself when it was built by init_device_mesh, create() or
  // flatten(); and the indices of this mesh's dims in it. Two sub-meshes of
  // one root can be combined into a layout over both (fully_shard over
  // parameters tensor parallelism already sharded does).
  DeviceMeshPtr root() const;
  const std::vector<int64_t>& dims_in_root() const { return dims_in_root_; }

  // Collective over the world: a mesh in which `names` (in mesh order) are
  // merged into one dim called `new_name` (default: names joined by "_"),
  // with its own group.
  DeviceMeshPtr flatten(const std::vector<std::string>& names, std::string new_name = "") const;

  // "DeviceMesh('cpu', shape [2, 2], ranks [0, 1, 2, 3], dims ['dp', 'tp'])".
  std::string describe() const;

  bool operator==(const DeviceMesh& other) const;
  bool operator!=(const DeviceMesh& other) const { return !(*this == other); }

 private:
  DeviceMesh() = default;
  int64_t checked_dim(int64_t dim) const;
  // Indices of `names`, which must be non-empty, distinct and in mesh order;
  // `what` starts the error messages ("sub-mesh names").
  std::vector<int64_t> dims_of(const std::vector<std::string>& names, const char* what) const;
  // Builds one group per slice along every dim (collective) and keeps ours.
  void make_groups();
  dist::GroupOptions group_options() const;

  std::string device_type_;
  c10::Device device_{c10::DeviceType::CPU};
  dist::BackendType backend_ = dist::BackendType::kGloo;
  std::vector<int64_t> shape_;
  std::vector<int> ranks_;
  std::vector<std::string> names_;
  std::vector<int64_t> coordinate_;
  std::vector<dist::GroupPtr> groups_;
  DeviceMeshPtr root_;                 // null for a root
  std::vector<int64_t> dims_in_root_;  // 0..ndim-1 for a root
};

// Collective: a mesh of `shape` over all ranks of the world (product of the
// shape must equal the world size).
DeviceMeshPtr init_device_mesh(const std::string& device_type, const std::vector<int64_t>& shape,
                               const std::vector<std::string>& names = {});

}  // namespace hp
