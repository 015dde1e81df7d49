// Root-mean-square layer normalisation, Llama's (N5 in docs/features.md):
//   y = weight * x / sqrt(mean(x^2 over the last dim) + eps)
// One parameter, `weight` [dim], initialised to 1; no bias, no mean
// subtraction. As in Hugging Face's LlamaRMSNorm, half and bfloat16 inputs
// are normalised in float32 and rounded back before the weight multiplies
// them; float32 and float64 inputs are normalised in their own dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "hp/nn/module.h"

namespace hp::nn {

class RMSNormImpl : public Module {
 public:
  // Throws hp::ArgumentError unless dim > 0 and eps > 0.
  RMSNormImpl(int64_t dim, double eps);
  // x [..., dim] -> the same shape and dtype.
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight;

 private:
  int64_t dim_;
  double eps_;
};
HP_MODULE(RMSNorm);

}  // namespace hp::nn
