// DTensor: a global tensor held as one local shard per rank of a mesh
// (T3-T6 in docs/features.md).
//
// Outside, a DTensor has the global shape; inside, the local shard and the
// Layout that says which slice (or partial value) it is. It is a value type:
// copies share the local tensor. Autograd flows through from_local,
// redistribute and to_local with torch's DTensor semantics: gradients are
// global, so the gradient of a Replicate value is the same on every rank
// unless to_local() is told otherwise. E.g. the gradient of S->R is a chunk
// when the incoming gradient is Replicate and a reduce_scatter when it is
// Partial (each rank's loss contributes), and the gradient of P->R passes
// through unchanged (identity to P). Partial(max/min) has no gradient: while
// grad is required, redistribute refuses it as source or target and
// to_local() as grad_placements (ArgumentError, before any collective).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/tensor/layout.h"

namespace hp {

struct GradLayoutCell;

class DTensor {
 public:
  DTensor() = default;

  bool defined() const { return local_.defined(); }
  const Layout& layout() const { return layout_; }
  const DeviceMeshPtr& mesh() const { return layout_.mesh(); }
  const Placements& placements() const { return layout_.placements(); }

  // Global shape.
  const std::vector<int64_t>& sizes() const { return shape_; }
  int64_t size(int64_t dim) const;
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t numel() const;
  // Contiguous strides of the global shape.
  std::vector<int64_t> strides() const;
  at::ScalarType scalar_type() const { return local_.scalar_type(); }
  bool requires_grad() const { return local_.requires_grad(); }

  // The local shard, connected to autograd. `grad_placements` declares the
  // layout of the gradient that will flow back into it (default: this
  // DTensor's placements); e.g. {Partial()} when each rank's loss is summed.
  at::Tensor to_local(const std::optional<Placements>& grad_placements = std::nullopt) const;
  // The local shard without gradient bookkeeping (for inspection).
  const at::Tensor& local() const { return local_; }
  std::vector<int64_t> local_shape() const;
  // Global offset of the local shard.
  std::vector<int64_t> local_offset() const;

  // A DTensor with the same global value in another layout on the same mesh.
  DTensor redistribute(const Layout& target) const;
  DTensor redistribute(const Placements& placements) const;
  // Same, in the alias form ("dp", "None", {"dp", "tp"}).
  DTensor redistribute(const AliasPlacements& alias) const;
  // The collective chain redistribute(target) would run.
  std::string explain(const Layout& target) const;

  // The whole global tensor on every rank (redistribute to Replicate).
  at::Tensor full_tensor() const;

  // "DTensor(shape [8, 4], Layout(...), local [4, 4] Float)".
  std::string str() const;

  // Internal: wraps an already-laid-out local tensor.
  DTensor(at::Tensor local, Layout layout, std::vector<int64_t> shape,
          std::shared_ptr<GradLayoutCell> grad_cell);

 private:
  at::Tensor local_;
  Layout layout_;
  std::vector<int64_t> shape_;
  // Where consumers record the layout of the gradient they will send back.
  std::shared_ptr<GradLayoutCell> grad_cell_;
};

// Splits `tensor` (the same on every rank) by `layout`: no communication,
// each rank keeps its slice. The local shard is a new leaf that requires
// grad iff `tensor` does. Partial placements partition the value (sum: the
// rank at coordinate 0 holds it, the others zeros; avg/max/min: every rank).
DTensor distribute_tensor(const at::Tensor& tensor, const Layout& layout);
DTensor distribute_tensor(const at::Tensor& tensor, DeviceMeshPtr mesh, const Placements& placements);

struct FromLocalOptions {
  // The global shape, the same on every rank. Without it, shards are assumed
  // even (torch's rule), unless run_check infers it. Without run_check only
  // this rank's own piece is checked against it (locally, no collective).
  std::optional<std::vector<int64_t>> shape;
  // Collective over the mesh: gathers every rank's local ndim, then shape,
  // infers the global shape when none is given, and raises the same
  // ArgumentError on every rank if ndims differ or the shapes do not fit the
  // layout (or `shape`).
  bool run_check = false;
};

// Wraps each rank's local tensor as a DTensor of `layout`; differentiable.
DTensor from_local(const at::Tensor& local, const Layout& layout, const FromLocalOptions& options = {});
DTensor from_local(const at::Tensor& local, DeviceMeshPtr mesh, const Placements& placements,
                   const FromLocalOptions& options = {});

}  // namespace hp
