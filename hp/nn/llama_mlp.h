// Llama's SwiGLU feed-forward sub-layer (N5 in docs/features.md):
//   down_proj(silu(gate_proj(x)) * up_proj(x)),
// gate_proj and up_proj n_embd -> intermediate_size, down_proj back; no
// biases. forward(x [..., n_embd]).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

#include "hp/nn/llama_config.h"
#include "hp/nn/module.h"

namespace hp::nn {

class LlamaMLPImpl : public Module {
 public:
  explicit LlamaMLPImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear gate_proj{nullptr};
  torch::nn::Linear up_proj{nullptr};
  torch::nn::Linear down_proj{nullptr};
};
HP_MODULE(LlamaMLP);

}  // namespace hp::nn
