#include "hp/nn/attention.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "hp/nn/linear.h"
#include "hp/util/error.h"

namespace hp::nn {

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& config)
    : Module("CausalSelfAttention"), config_(config) {
  config_.validate();
  const int64_t d = config_.n_embd;
  c_attn = register_module("c_attn", torch::nn::Linear(torch::nn::LinearOptions(d, 3 * d)));
  c_proj = register_module("c_proj", torch::nn::Linear(torch::nn::LinearOptions(d, d)));
}

at::Tensor CausalSelfAttentionImpl::forward(const at::Tensor& x) {
  const int64_t d = config_.n_embd;
  HP_CHECK_ARG(x.dim() == 3 && x.size(2) == d, "CausalSelfAttention.forward: x of shape ",
               x.sizes(), " must be [B, T, ", d, "]");
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t nh = config_.n_head, hd = config_.head_dim();

  auto qkv = linear(c_attn, x).split(d, /*dim=*/2);
  // [B, T, d] -> [B, nh, T, hd]
  auto heads = [&](const at::Tensor& t) { return t.view({B, T, nh, hd}).transpose(1, 2); };
  at::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);

  at::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
  at::Tensor future = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);
  att = att.masked_fill(future, -std::numeric_limits<double>::infinity()).softmax(-1);
  const bool drop = config_.dropout > 0 && is_training();
  if (drop) att = torch::dropout(att, config_.dropout, /*train=*/true);

  at::Tensor y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, d});
  y = linear(c_proj, y);
  if (drop) y = torch::dropout(y, config_.dropout, /*train=*/true);
  return y;
}

}  // namespace hp::nn
