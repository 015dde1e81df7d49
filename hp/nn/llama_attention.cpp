#include "hp/nn/llama_attention.h"

#include <torch/torch.h>

#include <cmath>
#include <limits>

#include "hp/nn/linear.h"
#include "hp/nn/rotary.h"
#include "hp/util/error.h"

namespace hp::nn {

namespace {

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

// Registration order q, k, v, o is Hugging Face's parameter order.
LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config)
    : Module("LlamaAttention"), config_(config) {
  config_.validate();
  const int64_t d = config_.n_embd, hd = config_.head_dim();
  q_proj = register_module("q_proj", linear(d, config_.n_head * hd));
  k_proj = register_module("k_proj", linear(d, config_.n_kv_head * hd));
  v_proj = register_module("v_proj", linear(d, config_.n_kv_head * hd));
  o_proj = register_module("o_proj", linear(config_.n_head * hd, d));
}

at::Tensor LlamaAttentionImpl::forward(const at::Tensor& x) {
  const int64_t d = config_.n_embd;
  HP_CHECK_ARG(x.dim() == 3 && x.size(2) == d, "LlamaAttention.forward: x of shape ", x.sizes(),
               " must be [B, T, ", d, "]");
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t nh = config_.n_head, nkv = config_.n_kv_head, hd = config_.head_dim();

  // [B, T, n * hd] -> [B, n, T, hd]
  auto heads = [&](const at::Tensor& t, int64_t n) {
    return t.view({B, T, n, hd}).transpose(1, 2);
  };
  at::Tensor q = heads(linear(q_proj, x), nh), k = heads(linear(k_proj, x), nkv),
             v = heads(linear(v_proj, x), nkv);
  auto [cos, sin] = rotary_tables(T, hd, config_.rope_theta, q.options());
  q = apply_rotary(q, cos, sin);
  k = apply_rotary(k, cos, sin);
  if (nkv != nh) {
    // Each kv head repeated for its group of query heads: [B, nkv, T, hd] ->
    // [B, nkv, g, T, hd] -> [B, nh, T, hd], head j * g + r being kv head j.
    const int64_t g = nh / nkv;
    auto repeat = [&](const at::Tensor& t) {
      return t.unsqueeze(2)
          .expand({B, nkv, g, T, hd})
          .clone(at::MemoryFormat::Contiguous)
          .view({B, nh, T, hd});
    };
    k = repeat(k);
    v = repeat(v);
  }

  at::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(double(hd)));
  at::Tensor future = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);
  att = att.masked_fill(future, -std::numeric_limits<double>::infinity()).softmax(-1);
  at::Tensor y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, nh * hd});
  return linear(o_proj, y);
}

}  // namespace hp::nn
