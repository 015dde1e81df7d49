#include "hp/nn/block.h"

#include <torch/torch.h>

namespace hp::nn {

namespace {
torch::nn::LayerNorm layer_norm(int64_t d) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5));
}
}  // namespace

// Registration order is parameter order (and so the order of the random draws
// at initialisation): ln_1, attn, ln_2, mlp, as in GPT-2.
BlockImpl::BlockImpl(const GPTConfig& config) : Module("Block") {
  config.validate();
  ln_1 = register_module("ln_1", layer_norm(config.n_embd));
  attn = register_module("attn", CausalSelfAttention(config));
  ln_2 = register_module("ln_2", layer_norm(config.n_embd));
  mlp = register_module("mlp", MLP(config));
}

at::Tensor BlockImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + attn(ln_1(x));
  return h + mlp(ln_2(h));
}

}  // namespace hp::nn
