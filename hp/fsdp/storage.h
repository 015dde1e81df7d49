// Freeing and refilling a tensor's memory while keeping its storage object.
//
// Tensors that autograd saved during forward (e.g. the transpose of a
// weight) are views of the parameter's storage. Freeing the memory behind
// that storage, and later allocating new memory into the same storage
// object, keeps those views valid without holding the memory in between.
// Neither call touches any tensor's sizes or version counter.
#pragma once

#include <cstddef>

#include <ATen/core/Tensor.h>

namespace hp::fsdp {

void free_storage(const at::Tensor& tensor);
// Gives the storage `nbytes` of fresh (uninitialised) memory if it has none.
void allocate_storage(const at::Tensor& tensor, size_t nbytes);
bool storage_is_allocated(const at::Tensor& tensor);
// A contiguous tensor of `sizes` whose storage has no memory yet: views of
// it may be taken, then free_storage puts it in the freed state that
// allocate_storage fills. Never read it before.
at::Tensor empty_unallocated(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace hp::fsdp
