#include "hp/tensor/dispatch/dtensor_impl.h"

#include <algorithm>
#include <numeric>

namespace hp::dispatch {

namespace {

// Contiguous strides over `shape`, with dims ordered as the local's strides
// order them (largest stride outermost; ties keep dim order).
std::vector<int64_t> virtual_strides(const std::vector<int64_t>& shape, const at::Tensor& local) {
  const int64_t n = static_cast<int64_t>(shape.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (local.dim() == n && !local.is_contiguous()) {
    auto local_strides = local.strides();
    auto local_sizes = local.sizes();
    // A size-1 dim's stride means nothing; place it by its index.
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const bool a1 = local_sizes[a] == 1, b1 = local_sizes[b] == 1;
      if (a1 || b1) return false;
      return local_strides[a] > local_strides[b];
    });
  }
  std::vector<int64_t> strides(n, 1);
  int64_t running = 1;
  for (int64_t i = n - 1; i >= 0; --i) {
    strides[order[i]] = running;
    running *= std::max<int64_t>(shape[order[i]], 1);
  }
  return strides;
}

}  // namespace

DTensorImpl::DTensorImpl(at::Tensor local, Layout layout, std::vector<int64_t> shape)
    : c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), local.dtype(),
                      local.device()),
      local_(std::move(local)),
      layout_(std::move(layout)),
      shape_(std::move(shape)) {
  set_storage_access_should_throw();
  refresh_geometry();
}

void DTensorImpl::refresh_geometry() {
  set_sizes_and_strides(shape_, virtual_strides(shape_, local_));
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, layout_, shape_);
  copy_tensor_metadata(this, impl.get(), version_counter, allow_tensor_metadata_change);
  return impl;
}

c10::intrusive_ptr<c10::TensorImpl> DTensorImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  auto impl = c10::make_intrusive<DTensorImpl>(local_, layout_, shape_);
  copy_tensor_metadata(this, impl.get(), std::move(version_counter), allow_tensor_metadata_change);
  return impl;
}

void DTensorImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  // set_data() only lets a DTensorImpl through here (same key set).
  auto* other = static_cast<DTensorImpl*>(impl.get());
  copy_tensor_metadata(other, this, version_counter(), allow_tensor_metadata_change());
  local_ = other->local_;
  layout_ = other->layout_;
  shape_ = other->shape_;
  refresh_numel();
  refresh_contiguous();
}

DTensorImpl* dtensor_impl(const at::Tensor& tensor) {
  if (!tensor.defined()) return nullptr;
  auto* impl = tensor.unsafeGetTensorImpl();
  if (!impl->key_set().has(c10::DispatchKey::PrivateUse1)) return nullptr;
  return dynamic_cast<DTensorImpl*>(impl);
}

at::Tensor wrap_local(at::Tensor local, Layout layout, std::vector<int64_t> shape) {
  ensure_registered();
  if (local.requires_grad()) local = local.detach();
  return at::Tensor(
      c10::make_intrusive<DTensorImpl>(std::move(local), std::move(layout), std::move(shape)));
}

}  // namespace hp::dispatch
