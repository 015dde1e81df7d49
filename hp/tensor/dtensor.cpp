#include "hp/tensor/dtensor.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <mutex>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/tensor/dtensor_autograd.h"
#include "hp/tensor/redistribute_exec.h"
#include "hp/tensor/redistribute_plan.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp {

// The layout in which the gradient of a DTensor will arrive, as declared by
// the ops that consume it. Its producer's backward reads it.
struct GradLayoutCell {
  std::mutex mutex;
  std::optional<Layout> layout;
  std::string recorded_by;

  void record(const Layout& grad_layout, const char* consumer) {
    std::lock_guard<std::mutex> lock(mutex);
    if (layout && *layout != grad_layout) {
      throw_argument_error(cat(
          consumer, " would send back a gradient laid out as ", grad_layout.spec().str(),
          " but ", recorded_by, " already declared ", layout->spec().str(),
          " for the same DTensor; autograd would add the two. Redistribute once and use the "
          "result in both places, or pass matching grad_placements to to_local()"));
    }
    layout = grad_layout;
    recorded_by = consumer;
  }

  Layout get_or(const Layout& fallback) {
    std::lock_guard<std::mutex> lock(mutex);
    return layout ? *layout : fallback;
  }
};

namespace {

using detail::attach;
using detail::gradient_layout;
using detail::needs_grad;
using torch::autograd::variable_list;

int64_t product_of_sharding_sizes(const Layout& layout, int64_t tensor_dim) {
  int64_t n = 1;
  for (int64_t m : layout.mesh_dims_of(tensor_dim)) n *= layout.mesh()->size(m);
  return n;
}

// d(mean of n partial values)/d(one of them) = 1/n: the product of the sizes
// of the Partial(avg) dims divides a global gradient into a local one.
int64_t average_divisor(const Layout& layout) {
  int64_t divisor = 1;
  for (int64_t m = 0; m < layout.mesh()->ndim(); ++m) {
    const Placement& p = layout.placements()[m];
    if (p.is_partial() && p.reduce_op() == dist::ReduceOp::kAvg) divisor *= layout.mesh()->size(m);
  }
  return divisor;
}

// Partial(max/min) has no gradient rule in terms of placements (the gradient
// belongs to whichever rank holds the extreme value, which no layout
// records), and moving a gradient through such a layout would silently
// all-reduce a max/min. So it is refused wherever it would enter a gradient's
// path: a redistribute's source or target, or a gradient layout declared to
// to_local(). `subject` and `context` place the layout in the message.
void check_differentiable(const Layout& layout, const char* subject, const char* context,
                          const char* remedy) {
  for (int64_t m = 0; m < layout.mesh()->ndim(); ++m) {
    const Placement& p = layout.placements()[m];
    HP_CHECK_ARG(!p.is_partial() || p.reduce_op() == dist::ReduceOp::kSum ||
                     p.reduce_op() == dist::ReduceOp::kAvg,
                 subject, " with ", p.str(), " on mesh dim '", layout.mesh()->dim_names()[m],
                 "' ", context,
                 " cannot be differentiated (the gradient of a max/min reduction is not defined "
                 "by placements); ", remedy);
  }
}

// Moves a gradient that arrived laid out as `arrived` into `target`.
at::Tensor move_gradient(const at::Tensor& grad, const Layout& arrived, const Layout& target,
                         const std::vector<int64_t>& shape) {
  return arrived == target ? grad : redistribute_local(grad, arrived, target, shape);
}

struct FromLocalBackward : torch::autograd::Node {
  Layout layout;
  std::vector<int64_t> shape;
  std::shared_ptr<GradLayoutCell> cell;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    Layout arrived = cell->get_or(layout);
    // As torch: a gradient in the DTensor's own layout is the local gradient.
    if (arrived == layout) return {grads[0]};
    at::Tensor g = move_gradient(grads[0], arrived, gradient_layout(layout), shape);
    const int64_t divisor = average_divisor(layout);
    return {divisor == 1 ? g : g / divisor};
  }
  std::string name() const override { return "hp::FromLocalBackward"; }
};

struct RedistributeBackward : torch::autograd::Node {
  Layout source, target;
  std::vector<int64_t> shape;
  std::shared_ptr<GradLayoutCell> cell;

  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {move_gradient(grads[0], cell->get_or(target), gradient_layout(source), shape)};
  }
  std::string name() const override { return "hp::RedistributeBackward"; }
};

void check_on_mesh(const Layout& layout, const char* op) {
  HP_CHECK_ARG(layout.defined(), op, ": the layout is undefined");
  HP_CHECK_ARG(layout.mesh()->contains_self(), op, ": rank ", dist::get_rank(),
               " is not part of ", layout.mesh()->describe());
}

// One row of integers from every rank of the mesh, each with its sender's
// mesh coordinate (collective; every rank must pass a row of the same length,
// which is why ndims are agreed before shapes are gathered). Every rank gets
// the rows in the same order, so a check that walks them raises the same
// message on every rank.
struct MeshRow {
  std::vector<int64_t> coordinate;
  std::vector<int64_t> values;
};

std::vector<MeshRow> gather_rows(const DeviceMesh& mesh, const std::vector<int64_t>& values) {
  const int64_t n = mesh.ndim();
  std::vector<int64_t> row = mesh.coordinate();
  row.insert(row.end(), values.begin(), values.end());
  const int64_t width = static_cast<int64_t>(row.size());
  at::Tensor table = at::tensor(row, at::kLong).view({1, width});
  for (int64_t m = n - 1; m >= 0; --m) {
    dist::Group& group = mesh.group(m);
    // On the group's device (an NCCL group refuses CPU tensors), read back
    // on the host.
    const auto options = at::TensorOptions(at::kLong).device(group.device());
    at::Tensor gathered = at::empty({group.size() * table.size(0), width}, options);
    dist::all_gather_into(group, gathered, table.to(group.device()).contiguous()).wait();
    table = gathered.cpu();
  }
  std::vector<MeshRow> rows;
  const int64_t* data = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < table.size(0); ++i) {
    const int64_t* r = data + i * width;
    rows.push_back({std::vector<int64_t>(r, r + n), std::vector<int64_t>(r + n, r + width)});
  }
  return rows;
}

// run_check's first step: every rank's local tensor must have the same ndim
// before shapes of that many entries are gathered. An undefined local tensor
// counts as ndim -1, so its rank raises together with the others.
void check_same_ndim(const DeviceMesh& mesh, const at::Tensor& local) {
  const auto rows = gather_rows(mesh, {local.defined() ? local.dim() : -1});
  const MeshRow& first = rows[0];
  for (const MeshRow& row : rows) {
    HP_CHECK_ARG(row.values[0] >= 0, "from_local: rank ", mesh.rank_at(row.coordinate),
                 " (coordinate ", to_string(row.coordinate),
                 ") passed an undefined local tensor; expected a tensor on every rank");
    HP_CHECK_ARG(row.values[0] == first.values[0], "from_local: rank ",
                 mesh.rank_at(row.coordinate), " (coordinate ", to_string(row.coordinate),
                 ") holds a local tensor with ", row.values[0], " dims but rank ",
                 mesh.rank_at(first.coordinate), " (coordinate ", to_string(first.coordinate),
                 ") holds one with ", first.values[0],
                 "; expected every rank's local tensor to have the global tensor's dims");
  }
}

// Every mesh rank's local shape (collective; ndims already agreed).
std::vector<MeshRow> gather_local_shapes(const DeviceMesh& mesh, const at::Tensor& local) {
  return gather_rows(mesh, local.sizes().vec());
}

// The global shape implied by every rank's local shape: along tensor dim d,
// the sum over one rank per combination of the coordinates sharding d.
std::vector<int64_t> infer_global_shape(const Layout& layout,
                                        const std::vector<MeshRow>& shapes) {
  const DeviceMesh& mesh = *layout.mesh();
  const int64_t ndim = static_cast<int64_t>(shapes[0].values.size());
  std::vector<int64_t> shape(ndim, 0);
  for (int64_t d = 0; d < ndim; ++d) {
    const auto sharding = layout.mesh_dims_of(d);
    for (const MeshRow& row : shapes) {
      bool counted = true;
      for (int64_t m = 0; m < mesh.ndim(); ++m) {
        bool shards_d = std::find(sharding.begin(), sharding.end(), m) != sharding.end();
        if (!shards_d && row.coordinate[m] != 0) counted = false;
      }
      if (counted) shape[d] += row.values[d];
    }
  }
  return shape;
}

void check_local_shapes(const Layout& layout, const std::vector<int64_t>& global,
                        const std::vector<MeshRow>& shapes) {
  const DeviceMesh& mesh = *layout.mesh();
  for (const MeshRow& row : shapes) {
    auto expected = local_shape(global, layout.spec(), mesh.shape(), row.coordinate);
    HP_CHECK_ARG(row.values == expected, "from_local: rank ", mesh.rank_at(row.coordinate),
                 " (coordinate ", to_string(row.coordinate), ") holds a local tensor of shape ",
                 to_string(row.values), " but ", to_string(layout.placements()),
                 " of global shape ", to_string(global), " gives it ", to_string(expected));
  }
}

}  // namespace

DTensor::DTensor(at::Tensor local, Layout layout, std::vector<int64_t> shape,
                 std::shared_ptr<GradLayoutCell> grad_cell)
    : local_(std::move(local)),
      layout_(std::move(layout)),
      shape_(std::move(shape)),
      grad_cell_(std::move(grad_cell)) {}

int64_t DTensor::size(int64_t dim) const {
  const int64_t n = this->dim();
  HP_CHECK_ARG(dim >= -n && dim < n, "DTensor::size: dim ", dim, " is out of range for a ",
               n, "-d DTensor");
  return shape_[dim < 0 ? dim + n : dim];
}

int64_t DTensor::numel() const { return c10::multiply_integers(shape_); }

std::vector<int64_t> DTensor::strides() const {
  return c10::IntArrayRef(c10::contiguous_strides(shape_)).vec();
}

std::vector<int64_t> DTensor::local_shape() const { return local_.sizes().vec(); }

std::vector<int64_t> DTensor::local_offset() const {
  return layout_.local_offset(shape_);
}

at::Tensor DTensor::to_local(const std::optional<Placements>& grad_placements) const {
  HP_CHECK_ARG(defined(), "to_local: the DTensor is undefined");
  if (grad_placements) {
    Layout grad_layout = Layout(mesh(), *grad_placements).normalized(dim());
    auto grad_shape = grad_layout.local_shape(shape_);
    HP_CHECK_ARG(grad_shape == local_.sizes().vec(), "to_local: grad_placements ",
                 to_string(*grad_placements), " give this rank a gradient of shape ",
                 to_string(grad_shape), " but its local tensor under ", to_string(placements()),
                 " has shape ", to_string(local_.sizes().vec()),
                 "; expected placements that shard the same dims the same way");
    if (grad_cell_ && needs_grad(local_)) {
      // The DTensor's own layout passes the gradient through unchanged; any
      // other is moved by the producer's backward, which max/min cannot be.
      if (grad_layout != layout_) {
        check_differentiable(grad_layout, "to_local: grad_placements",
                             "for a DTensor that requires grad",
                             "declare the gradient Replicate() or Partial(\"sum\") instead");
      }
      grad_cell_->record(grad_layout, "to_local()");
    }
  } else if (grad_cell_ && needs_grad(local_)) {
    grad_cell_->record(layout_, "to_local()");
  }
  return local_;
}

DTensor DTensor::redistribute(const Layout& target) const {
  HP_CHECK_ARG(defined(), "redistribute: the DTensor is undefined");
  HP_CHECK_ARG(target.defined(), "redistribute: the target layout is undefined");
  HP_CHECK_ARG(*target.mesh() == *mesh(), "redistribute: the target mesh ",
               target.mesh()->describe(), " differs from the DTensor's mesh ", mesh()->describe(),
               "; redistribute only moves data within one mesh");
  Layout dst = target.normalized(dim());
  if (dst == layout_) return *this;
  const bool grad = needs_grad(local_);
  // Refusals come before the plan's collectives, so no rank is left waiting.
  if (grad) {
    check_differentiable(layout_, "redistribute: a DTensor", "that requires grad",
                         "detach it or reduce it first");
    check_differentiable(dst, "redistribute: a target layout",
                         "for a DTensor that requires grad",
                         "detach it first or redistribute to Replicate() instead");
    if (grad_cell_) grad_cell_->record(gradient_layout(layout_), "redistribute()");
  }
  at::Tensor out = redistribute_local(local_, layout_, dst, shape_);
  if (!grad) return DTensor(out, dst, shape_, nullptr);
  auto cell = std::make_shared<GradLayoutCell>();
  auto node = compat::make_autograd_node<RedistributeBackward>();
  node->source = layout_;
  node->target = dst;
  node->shape = shape_;
  node->cell = cell;
  return DTensor(attach(node, local_, out), dst, shape_, cell);
}

DTensor DTensor::redistribute(const Placements& placements) const {
  return redistribute(Layout(mesh(), placements));
}

DTensor DTensor::redistribute(const AliasPlacements& alias) const {
  HP_CHECK_ARG(static_cast<int64_t>(alias.size()) == dim(), "redistribute: alias placements have ",
               alias.size(), " entries for a ", dim(), "-d DTensor; expected one per tensor dim");
  return redistribute(Layout::from_alias(mesh(), alias));
}

std::string DTensor::explain(const Layout& target) const {
  Layout dst = target.normalized(dim());
  return plan_redistribute(layout_.spec(), dst.spec())->explain(mesh().get());
}

at::Tensor DTensor::full_tensor() const {
  return redistribute(Layout::replicated(mesh())).to_local();
}

std::string DTensor::str() const {
  if (!defined()) return "DTensor(undefined)";
  return cat("DTensor(shape ", to_string(shape_), ", ", layout_.str(), ", local ",
             to_string(local_.sizes().vec()), " ", local_.scalar_type(), ")");
}

DTensor distribute_tensor(const at::Tensor& tensor, const Layout& layout) {
  HP_CHECK_ARG(tensor.defined(), "distribute_tensor: tensor is undefined");
  check_on_mesh(layout, "distribute_tensor");
  Layout norm = layout.normalized(tensor.dim());
  // From Replicate, the planner's steps are all local (chunks, strided
  // chunks, partitions): each rank keeps its piece, nothing is sent.
  const at::Tensor whole = tensor.detach();
  at::Tensor local =
      redistribute_local(whole, Layout::replicated(norm.mesh()), norm, whole.sizes().vec());
  // A layout that keeps it all (Replicate, or one rank per sharding mesh
  // dim) may hand back the input's storage; the DTensor owns its own.
  const bool shares = local.is_same(whole) || (local.has_storage() && whole.has_storage() &&
                                               local.is_alias_of(whole));
  if (shares) local = whole.clone(at::MemoryFormat::Contiguous);
  local.requires_grad_(tensor.requires_grad());
  return DTensor(local, norm, whole.sizes().vec(), nullptr);
}

DTensor distribute_tensor(const at::Tensor& tensor, DeviceMeshPtr mesh,
                          const Placements& placements) {
  return distribute_tensor(tensor, Layout(std::move(mesh), placements));
}

DTensor from_local(const at::Tensor& local, const Layout& layout,
                   const FromLocalOptions& options) {
  check_on_mesh(layout, "from_local");
  const DeviceMesh& mesh = *layout.mesh();
  // With run_check a rank must not raise alone while the others wait in its
  // gathers: ndims are agreed first (collectively), then checks that depend
  // only on them and on arguments every rank shares, then the local shapes
  // are checked over the gathered table, identically on every rank.
  if (options.run_check) check_same_ndim(mesh, local);
  HP_CHECK_ARG(local.defined(), "from_local: local tensor is undefined");
  Layout norm = layout.normalized(local.dim());
  std::vector<int64_t> shape;
  if (options.shape) {
    shape = *options.shape;
    HP_CHECK_ARG(static_cast<int64_t>(shape.size()) == local.dim(), "from_local: shape ",
                 to_string(shape), " has ", shape.size(), " dims but the local tensor has ",
                 local.dim());
  }
  if (options.run_check) {
    auto shapes = gather_local_shapes(mesh, local);
    if (!options.shape) shape = infer_global_shape(norm, shapes);
    check_local_shapes(norm, shape, shapes);
  } else if (options.shape) {
    // No collective here, so this rank's own piece is all it can check.
    auto expected = norm.local_shape(shape);
    HP_CHECK_ARG(expected == local.sizes().vec(), "from_local: the local tensor of shape ",
                 to_string(local.sizes().vec()), " on rank ", dist::get_rank(),
                 " (coordinate ", to_string(mesh.coordinate()), ") does not fit ",
                 to_string(norm.placements()), " of global shape ", to_string(shape),
                 ", which gives it ", to_string(expected));
  } else {
    shape = local.sizes().vec();
    for (int64_t d = 0; d < local.dim(); ++d) shape[d] *= product_of_sharding_sizes(norm, d);
  }
  if (!needs_grad(local)) return DTensor(local, norm, shape, nullptr);
  auto cell = std::make_shared<GradLayoutCell>();
  auto node = compat::make_autograd_node<FromLocalBackward>();
  node->layout = norm;
  node->shape = shape;
  node->cell = cell;
  return DTensor(attach(node, local, local), norm, shape, cell);
}

DTensor from_local(const at::Tensor& local, DeviceMeshPtr mesh, const Placements& placements,
                   const FromLocalOptions& options) {
  return from_local(local, Layout(std::move(mesh), placements), options);
}

}  // namespace hp
