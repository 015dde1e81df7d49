// DTensorImpl: the TensorImpl behind a tensor-form DTensor (dtensor_tensor.h).
//
// It has no storage. It reports the global shape, the local shard's dtype
// and device, and strides that are contiguous over the global shape in the
// local shard's dim order (autograd formulas choose paths by strides, so a
// transposed local must look transposed). Its dispatch key is PrivateUse1,
// so every op on it reaches the sharding-rule fallback (op_dispatch.cpp)
// below autograd. The local shard never requires grad: autograd runs on the
// wrapper.
//
// Both shallow_copy_and_detach overloads and shallow_copy_from are
// overridden: detach(), .data, saved variables and gradient accumulation use
// them, and TensorImpl's versions would drop the local shard.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include "hp/tensor/layout.h"

namespace hp::dispatch {

class DTensorImpl : public c10::TensorImpl {
 public:
  DTensorImpl(at::Tensor local, Layout layout, std::vector<int64_t> shape);

  const at::Tensor& local() const { return local_; }
  const Layout& layout() const { return layout_; }
  const std::vector<int64_t>& global_shape() const { return shape_; }

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;

 private:
  void refresh_geometry();

  at::Tensor local_;
  Layout layout_;
  std::vector<int64_t> shape_;
};

// The impl of a tensor-form DTensor, or nullptr for any other tensor.
DTensorImpl* dtensor_impl(const at::Tensor& tensor);

// Wraps a local shard (detached from autograd) as a tensor-form DTensor of
// `layout` and global `shape`. No autograd history; registers the op
// fallback on first use.
at::Tensor wrap_local(at::Tensor local, Layout layout, std::vector<int64_t> shape);

// Registers the PrivateUse1 fallback and the direct registrations (once).
void ensure_registered();

}  // namespace hp::dispatch
