// A pre-LayerNorm transformer block, GPT-2's (N2 in docs/features.md):
//   x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
// attn and mlp are called through their holders, so hooks registered on them
// run; the block itself is the usual fully_shard unit.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/normalization.h>

#include "hp/nn/attention.h"
#include "hp/nn/gpt_config.h"
#include "hp/nn/mlp.h"
#include "hp/nn/module.h"

namespace hp::nn {

class BlockImpl : public Module {
 public:
  explicit BlockImpl(const GPTConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::LayerNorm ln_1{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::LayerNorm ln_2{nullptr};
  MLP mlp{nullptr};
};
HP_MODULE(Block);

}  // namespace hp::nn
