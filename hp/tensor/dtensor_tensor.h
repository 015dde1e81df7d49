// DTensors as ordinary at::Tensors (T7 in docs/features.md).
//
// A tensor-form DTensor is an at::Tensor whose TensorImpl holds a DTensor:
// it reports the global shape, the local shard's dtype and device, and runs
// every libtorch op through a sharding rule that derives the output layout
// from the input layouts, redistributes inputs that disagree, and runs the op
// on the local shards. Autograd works on the global tensors (the gradient of
// a tensor-form leaf is a tensor-form DTensor and accumulates across
// backwards), so unmodified modules, losses, torch::optim::AdamW and
// clip_grad_norm_ run on tensor-form parameters and activations.
//
// An op without a rule raises hp::ArgumentError naming the op and its input
// placements; nothing is ever gathered silently. A plain (non-DTensor)
// tensor mixed into an op with DTensors counts as Replicate: it must hold the
// same value on every rank (a causal mask, a scalar).
//
// docs/design.md ("DTensor op dispatch") describes the mechanism and the
// rules; hp::DTensor (dtensor.h) is the same value in value form.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/tensor/dtensor.h"
#include "hp/tensor/layout.h"

namespace hp {

// Whether `tensor` is a tensor-form DTensor.
bool is_dtensor(const at::Tensor& tensor);

// The tensor form of `dtensor`. Differentiable: a gradient reaching the
// result flows back into `dtensor`'s local shard.
at::Tensor as_tensor(const DTensor& dtensor);

// The value form of a tensor-form DTensor; shares the local shard.
// Differentiable like as_tensor.
DTensor as_dtensor(const at::Tensor& tensor);

// Splits `full` (the same on every rank) by `layout` with no communication
// and returns the tensor form: a new leaf that requires grad iff `full`
// does. Typical for parameters.
at::Tensor distribute(const at::Tensor& full, const Layout& layout);

// Wraps this rank's shard `local` of a tensor of global `shape` laid out as
// `layout` as a tensor form, with no autograd history and no check beyond
// definedness: the caller guarantees that `local` is that piece (e.g.
// FSDP's views into its flat buffers). Shares `local`'s storage.
at::Tensor wrap_local_shard(const at::Tensor& local, const Layout& layout,
                            const std::vector<int64_t>& shape);

// The layout of a tensor-form DTensor (ArgumentError for a plain tensor).
const Layout& layout_of(const at::Tensor& tensor);
// Its local shard, outside autograd (for inspection and for optimizers'
// own bookkeeping).
const at::Tensor& local_of(const at::Tensor& tensor);

// Differentiable redistribute of a tensor-form DTensor (same semantics and
// gradient rules as DTensor::redistribute).
at::Tensor redistribute(const at::Tensor& tensor, const Layout& target);
at::Tensor redistribute(const at::Tensor& tensor, const Placements& target);

// The local shard, connected to autograd; `grad_placements` declares the
// layout of the gradient that will flow back (default: the tensor's own).
at::Tensor to_local(const at::Tensor& tensor,
                    const std::optional<Placements>& grad_placements = std::nullopt);

// The global value on every rank (redistribute to Replicate, then local).
at::Tensor full_tensor(const at::Tensor& tensor);

}  // namespace hp
