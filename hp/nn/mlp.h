// GPT-2's feed-forward sub-layer (N2): c_fc (n_embd -> 4 n_embd), exact
// (erf) GELU, c_proj (4 n_embd -> n_embd). forward(x [..., n_embd]).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/linear.h>

#include "hp/nn/gpt_config.h"
#include "hp/nn/module.h"

namespace hp::nn {

class MLPImpl : public Module {
 public:
  explicit MLPImpl(const GPTConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear c_fc{nullptr};
  torch::nn::Linear c_proj{nullptr};

 private:
  double dropout_;
};
HP_MODULE(MLP);

}  // namespace hp::nn
