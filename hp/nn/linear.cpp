#include "hp/nn/linear.h"

#include <ATen/ATen.h>

namespace hp::nn {

at::Tensor linear(const torch::nn::Linear& layer, const at::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias);
}

}  // namespace hp::nn
