// The language-model loss (N2 in docs/features.md).
#pragma once

#include <ATen/core/Tensor.h>

namespace hp::nn {

// Mean cross-entropy over all B*T tokens: logits float [B, T, V], targets
// int64 [B, T] with ids in [0, V). Throws hp::ArgumentError on a shape, dtype
// or range mismatch.
at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& targets);

}  // namespace hp::nn
