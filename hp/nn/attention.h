// Causal multi-head self-attention, GPT-2's (N2 in docs/features.md).
//
// forward(x [B, T, n_embd]) -> [B, T, n_embd]. One fused projection c_attn
// (n_embd -> 3 n_embd, split into q, k, v in that order), scores scaled by
// 1/sqrt(head_dim), -inf above the diagonal so position t sees positions
// <= t only, softmax over keys, then c_proj. The causal mask is computed per
// call rather than registered, so state_dict holds parameters only and the
// mask follows x to whatever device it is on.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

#include "hp/nn/gpt_config.h"
#include "hp/nn/module.h"

namespace hp::nn {

class CausalSelfAttentionImpl : public Module {
 public:
  explicit CausalSelfAttentionImpl(const GPTConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear c_attn{nullptr};
  torch::nn::Linear c_proj{nullptr};

 private:
  GPTConfig config_;
};
HP_MODULE(CausalSelfAttention);

}  // namespace hp::nn
