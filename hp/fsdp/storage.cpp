#include "hp/fsdp/storage.h"

#include <c10/core/StorageImpl.h>

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

}  // namespace hp::fsdp
