#include "hp/fsdp/storage.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/accumulate.h>

namespace hp::fsdp {

void free_storage(const at::Tensor& tensor) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(0);
}

void allocate_storage(const at::Tensor& tensor, size_t nbytes) {
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  if (storage->nbytes() == nbytes && storage->data() != nullptr) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

bool storage_is_allocated(const at::Tensor& tensor) {
  return tensor.storage().unsafeGetStorageImpl()->data() != nullptr;
}

at::Tensor empty_unallocated(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor tensor = at::empty({0}, options);
  // The storage claims its full size (views of the tensor pass libtorch's
  // bounds checks) but holds no memory, as after free_storage.
  c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(c10::DataPtr(nullptr, storage->device()));
  storage->set_nbytes(static_cast<size_t>(c10::multiply_integers(sizes)) *
                      static_cast<size_t>(tensor.element_size()));
  tensor.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return tensor;
}

}  // namespace hp::fsdp
