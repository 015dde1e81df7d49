// The language-model loss (N2 in docs/features.md).
#pragma once

#include <ATen/core/Tensor.h>

namespace hp::nn {

// Mean cross-entropy over all B*T tokens: logits float [B, T, V], targets
// int64 [B, T] with ids in [0, V). Throws hp::ArgumentError on a shape or
// dtype mismatch, and on CPU targets out of range; on a GPU an out-of-range
// target stops the kernel with its device-side assert (checking on the host
// would sync every step).
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace hp::nn
