// A Llama decoder layer (N5 in docs/features.md; Hugging Face's
// LlamaDecoderLayer), pre-norm:
//   x = x + self_attn(input_layernorm(x))
//   x = x + mlp(post_attention_layernorm(x))
// self_attn and mlp are called through their holders, so hooks registered
// on them run; the layer itself is the usual fully_shard unit.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/nn/llama_attention.h"
#include "hp/nn/llama_config.h"
#include "hp/nn/llama_mlp.h"
#include "hp/nn/module.h"
#include "hp/nn/rms_norm.h"

namespace hp::nn {

class LlamaDecoderLayerImpl : public Module {
 public:
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  // x [B, T, n_embd] -> [B, T, n_embd]
  at::Tensor forward(const at::Tensor& x);

  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
};
HP_MODULE(LlamaDecoderLayer);

}  // namespace hp::nn
