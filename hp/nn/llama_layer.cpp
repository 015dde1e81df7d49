#include "hp/nn/llama_layer.h"

#include <torch/torch.h>

namespace hp::nn {

// Registration order is Hugging Face's (and so the parameter order):
// self_attn, mlp, input_layernorm, post_attention_layernorm.
LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config)
    : Module("LlamaDecoderLayer") {
  config.validate();
  self_attn = register_module("self_attn", LlamaAttention(config));
  mlp = register_module("mlp", LlamaMLP(config));
  input_layernorm =
      register_module("input_layernorm", RMSNorm(config.n_embd, config.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(config.n_embd, config.rms_norm_eps));
}

at::Tensor LlamaDecoderLayerImpl::forward(const at::Tensor& x) {
  at::Tensor h = x + self_attn(input_layernorm(x));
  return h + mlp(post_attention_layernorm(h));
}

}  // namespace hp::nn
