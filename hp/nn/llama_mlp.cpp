#include "hp/nn/llama_mlp.h"

#include <torch/torch.h>

#include "hp/nn/linear.h"

namespace hp::nn {

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& config) : Module("LlamaMLP") {
  config.validate();
  const int64_t d = config.n_embd, m = config.intermediate_size;
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  gate_proj = register_module("gate_proj", linear(d, m));
  up_proj = register_module("up_proj", linear(d, m));
  down_proj = register_module("down_proj", linear(m, d));
}

at::Tensor LlamaMLPImpl::forward(const at::Tensor& x) {
  return linear(down_proj, torch::silu(linear(gate_proj, x)) * linear(up_proj, x));
}

}  // namespace hp::nn
