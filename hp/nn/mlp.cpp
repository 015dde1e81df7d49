#include "hp/nn/mlp.h"

#include <torch/torch.h>

#include "hp/nn/linear.h"

namespace hp::nn {

MLPImpl::MLPImpl(const GPTConfig& config) : Module("MLP"), dropout_(config.dropout) {
  config.validate();
  const int64_t d = config.n_embd;
  c_fc = register_module("c_fc", torch::nn::Linear(torch::nn::LinearOptions(d, 4 * d)));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(4 * d, d)));
}

at::Tensor MLPImpl::forward(const at::Tensor& x) {
  // torch::gelu's default approximation is "none": the exact erf form.
  at::Tensor y = linear(c_proj, torch::gelu(linear(c_fc, x)));
  if (dropout_ > 0 && is_training()) y = torch::dropout(y, dropout_, /*train=*/true);
  return y;
}

}  // namespace hp::nn
