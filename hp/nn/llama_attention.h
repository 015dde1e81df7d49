// Causal grouped-query self-attention with rotary positions, Llama's
// (N5 in docs/features.md; Hugging Face's LlamaAttention).
//
// forward(x [B, T, n_embd]) -> [B, T, n_embd]. q_proj, k_proj, v_proj and
// o_proj carry no bias; k_proj and v_proj give n_kv_head heads, each shared
// by n_head / n_kv_head consecutive query heads (kv head j serves query
// heads j * g ... j * g + g - 1, Hugging Face's repeat_kv). Queries and keys
// are turned by the rotary embedding (hp/nn/rotary.h), scores scaled by
// 1/sqrt(head_dim) and masked above the diagonal. The rotary tables and the
// mask are computed per call, so state_dict holds the four weights only.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

#include "hp/nn/llama_config.h"
#include "hp/nn/module.h"

namespace hp::nn {

class LlamaAttentionImpl : public Module {
 public:
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear q_proj{nullptr};  // [n_head * head_dim, n_embd]
  torch::nn::Linear k_proj{nullptr};  // [n_kv_head * head_dim, n_embd]
  torch::nn::Linear v_proj{nullptr};  // [n_kv_head * head_dim, n_embd]
  torch::nn::Linear o_proj{nullptr};  // [n_embd, n_head * head_dim]

 private:
  LlamaConfig config_;
};
HP_MODULE(LlamaAttention);

}  // namespace hp::nn
