#include "hp/tensor/dtensor_tensor.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/variable.h>

#include "hp/tensor/dispatch/dtensor_impl.h"
#include "hp/tensor/dtensor_autograd.h"
#include "hp/tensor/redistribute_exec.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"

namespace hp {

namespace {

using dispatch::DTensorImpl;
using dispatch::dtensor_impl;
using dispatch::wrap_local;
using detail::attach;
using detail::gradient_layout;
using detail::needs_grad;
using torch::autograd::variable_list;

const DTensorImpl& checked_impl(const at::Tensor& t, const char* fn) {
  const DTensorImpl* impl = dtensor_impl(t);
  HP_CHECK_ARG(impl != nullptr, fn, ": expected a tensor-form DTensor but got a plain tensor",
               t.defined() ? " of shape " + to_string(t.sizes().vec()) : std::string(" (undefined)"),
               "; make one with hp::distribute() or hp::as_tensor()");
  return *impl;
}

// A tensor-form gradient moved into `layout` (a plain one is taken as is).
at::Tensor grad_into(const at::Tensor& grad, const Layout& layout) {
  const DTensorImpl* impl = dtensor_impl(grad);
  if (!impl || impl->layout() == layout) return grad;
  return wrap_local(
      redistribute_local(impl->local(), impl->layout(), layout, impl->global_shape()), layout,
      impl->global_shape());
}

// Backward of local -> tensor form: the gradient, moved into the layout the
// local's producer expects, unwrapped.
struct WrapBackward : torch::autograd::Node {
  Layout grad_layout;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    at::Tensor g = grad_into(grads[0], grad_layout);
    const DTensorImpl* impl = dtensor_impl(g);
    return {impl ? impl->local() : g};
  }
  std::string name() const override { return "hp::WrapBackward"; }
};

// Backward of tensor form -> local: the local gradient, wrapped.
struct UnwrapBackward : torch::autograd::Node {
  Layout grad_layout;
  std::vector<int64_t> shape;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {wrap_local(grads[0], grad_layout, shape)};
  }
  std::string name() const override { return "hp::UnwrapBackward"; }
};

struct TensorRedistributeBackward : torch::autograd::Node {
  Layout source_grad_layout;
  variable_list apply(variable_list&& grads) override {
    if (!grads[0].defined()) return {at::Tensor()};
    return {grad_into(grads[0], source_grad_layout)};
  }
  std::string name() const override { return "hp::TensorRedistributeBackward"; }
};

at::Tensor wrap_differentiable(const at::Tensor& local, const Layout& layout,
                               const std::vector<int64_t>& shape, const Layout& grad_layout) {
  at::Tensor out = wrap_local(local.detach(), layout, shape);
  if (!needs_grad(local)) return out;
  auto node = compat::make_autograd_node<WrapBackward>();
  node->grad_layout = grad_layout;
  return attach(node, local, out);
}

}  // namespace

bool is_dtensor(const at::Tensor& tensor) { return dtensor_impl(tensor) != nullptr; }

const Layout& layout_of(const at::Tensor& tensor) {
  return checked_impl(tensor, "layout_of").layout();
}

const at::Tensor& local_of(const at::Tensor& tensor) {
  return checked_impl(tensor, "local_of").local();
}

at::Tensor as_tensor(const DTensor& dtensor) {
  HP_CHECK_ARG(dtensor.defined(), "as_tensor: the DTensor is undefined");
  const Layout grad_layout = gradient_layout(dtensor.layout());
  at::Tensor local = dtensor.to_local(grad_layout.placements());
  return wrap_differentiable(local, dtensor.layout(), dtensor.sizes(), grad_layout);
}

DTensor as_dtensor(const at::Tensor& tensor) {
  const DTensorImpl& impl = checked_impl(tensor, "as_dtensor");
  FromLocalOptions options;
  options.shape = impl.global_shape();
  return from_local(to_local(tensor), impl.layout(), options);
}

at::Tensor distribute(const at::Tensor& full, const Layout& layout) {
  HP_CHECK_ARG(full.defined(), "distribute: the tensor is undefined");
  HP_CHECK_ARG(!is_dtensor(full), "distribute: the tensor is already a DTensor (",
               layout_of(full).str(), "); use hp::redistribute to change its layout");
  DTensor d = distribute_tensor(full.detach(), layout);
  at::Tensor out = wrap_local(d.local(), d.layout(), d.sizes());
  if (full.requires_grad()) {
    out.set_requires_grad(true);
    // A leaf's gradient is kept in the leaf's own layout, whatever layout the
    // rules gave it (e.g. an embedding table's gradient arrives Replicate):
    // optimizers then update shards with shards.
    const Layout leaf_layout = d.layout();
    out.register_hook([leaf_layout](const at::Tensor& grad) { return grad_into(grad, leaf_layout); });
  }
  return out;
}

at::Tensor redistribute(const at::Tensor& tensor, const Layout& target) {
  const DTensorImpl& impl = checked_impl(tensor, "redistribute");
  HP_CHECK_ARG(target.defined(), "redistribute: the target layout is undefined");
  HP_CHECK_ARG(*target.mesh() == *impl.layout().mesh(), "redistribute: the target mesh ",
               target.mesh()->describe(), " differs from the tensor's mesh ",
               impl.layout().mesh()->describe());
  const Layout dst = target.normalized(static_cast<int64_t>(impl.global_shape().size()));
  if (dst == impl.layout()) return tensor;
  at::Tensor out =
      wrap_local(redistribute_local(impl.local(), impl.layout(), dst, impl.global_shape()), dst,
                 impl.global_shape());
  if (!needs_grad(tensor)) return out;
  auto node = compat::make_autograd_node<TensorRedistributeBackward>();
  node->source_grad_layout = gradient_layout(impl.layout());
  return attach(node, tensor, out);
}

at::Tensor redistribute(const at::Tensor& tensor, const Placements& target) {
  return redistribute(tensor, Layout(checked_impl(tensor, "redistribute").layout().mesh(), target));
}

at::Tensor to_local(const at::Tensor& tensor, const std::optional<Placements>& grad_placements) {
  const DTensorImpl& impl = checked_impl(tensor, "to_local");
  Layout grad_layout = impl.layout();
  if (grad_placements) {
    grad_layout = Layout(impl.layout().mesh(), *grad_placements)
                      .normalized(static_cast<int64_t>(impl.global_shape().size()));
    const auto want = grad_layout.local_shape(impl.global_shape());
    HP_CHECK_ARG(want == impl.local().sizes().vec(), "to_local: grad_placements ",
                 to_string(*grad_placements), " give this rank a gradient of shape ",
                 to_string(want), " but the local shard has shape ",
                 to_string(impl.local().sizes().vec()));
  }
  at::Tensor local = impl.local().detach();
  if (!needs_grad(tensor)) return local;
  auto node = compat::make_autograd_node<UnwrapBackward>();
  node->grad_layout = grad_layout;
  node->shape = impl.global_shape();
  return attach(node, tensor, local);
}

at::Tensor wrap_local_shard(const at::Tensor& local, const Layout& layout,
                            const std::vector<int64_t>& shape) {
  HP_CHECK_ARG(local.defined(), "wrap_local_shard: the local shard is undefined");
  HP_CHECK_ARG(layout.defined(), "wrap_local_shard: the layout is undefined");
  return wrap_local(local, layout, shape);
}

at::Tensor full_tensor(const at::Tensor& tensor) {
  const DTensorImpl& impl = checked_impl(tensor, "full_tensor");
  return to_local(redistribute(tensor, Layout::replicated(impl.layout().mesh())));
}

}  // namespace hp
