// Autograd plumbing shared by DTensor's value form (dtensor.cpp) and tensor
// form (dtensor_tensor.cpp): internal to hp/tensor, not part of the API.
//
// Both forms attach hand-written nodes to fresh outputs (from_local,
// redistribute, to_local, wrapping and unwrapping); the nodes run in
// autograd's threads and only read what they were given when built.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "hp/tensor/layout.h"
#include "hp/util/torch_compat.h"

namespace hp::detail {

// Whether autograd records an op on `t` now.
inline bool needs_grad(const at::Tensor& t) {
  return at::GradMode::is_enabled() && t.requires_grad();
}

// The layout in which a value laid out as `layout` receives its (global)
// gradient: a Partial value's gradient is the whole gradient on every rank
// (torch's rule), so Partial dims become Replicate.
inline Layout gradient_layout(const Layout& layout) { return layout.without_partial(); }

// Makes `out` the output of `node`, whose input is `input`. An `out` that is
// `input` itself (a pass-through) is detached first, so that the history is
// set on a tensor of its own.
template <typename NodeT>
at::Tensor attach(compat::AutogradNodePtr<NodeT> node, const at::Tensor& input, at::Tensor out) {
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  if (out.is_same(input)) out = input.detach();
  torch::autograd::set_history(out, node);
  return out;
}

}  // namespace hp::detail
