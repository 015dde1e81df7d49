#include "hp/nn/llama_config.h"

#include <cmath>
#include <utility>

#include "hp/util/error.h"

namespace hp::nn {

void LlamaConfig::validate() const {
  HP_CHECK_ARG(vocab_size > 0, "LlamaConfig.vocab_size ", vocab_size, " must be positive");
  HP_CHECK_ARG(context > 0, "LlamaConfig.context ", context, " must be positive");
  HP_CHECK_ARG(n_layer > 0, "LlamaConfig.n_layer ", n_layer, " must be positive");
  HP_CHECK_ARG(n_head > 0, "LlamaConfig.n_head ", n_head, " must be positive");
  HP_CHECK_ARG(n_kv_head > 0, "LlamaConfig.n_kv_head ", n_kv_head, " must be positive");
  HP_CHECK_ARG(n_embd > 0, "LlamaConfig.n_embd ", n_embd, " must be positive");
  HP_CHECK_ARG(intermediate_size > 0, "LlamaConfig.intermediate_size ", intermediate_size,
               " must be positive");
  HP_CHECK_ARG(n_embd % n_head == 0, "LlamaConfig.n_embd ", n_embd,
               " must be divisible by n_head ", n_head);
  // Rotary embedding turns pairs of features (i, i + head_dim / 2).
  HP_CHECK_ARG(head_dim() % 2 == 0, "LlamaConfig.n_embd / n_head = ", head_dim(),
               " (the head dim) must be even for the rotary embedding");
  HP_CHECK_ARG(n_head % n_kv_head == 0, "LlamaConfig.n_head ", n_head,
               " must be divisible by n_kv_head ", n_kv_head,
               " (each key/value head serves a group of query heads)");
  HP_CHECK_ARG(rms_norm_eps > 0 && std::isfinite(rms_norm_eps), "LlamaConfig.rms_norm_eps ",
               rms_norm_eps, " must be positive and finite");
  HP_CHECK_ARG(rope_theta > 1 && std::isfinite(rope_theta), "LlamaConfig.rope_theta ",
               rope_theta, " must be finite and greater than 1");
  HP_CHECK_ARG(initializer_range > 0 && std::isfinite(initializer_range),
               "LlamaConfig.initializer_range ", initializer_range,
               " must be positive and finite");
}

std::vector<ParameterShape> LlamaConfig::parameter_shapes() const {
  const int64_t d = n_embd, hd = head_dim(), m = intermediate_size;
  std::vector<ParameterShape> shapes = {{"model.embed_tokens.weight", {vocab_size, d}}};
  for (int64_t i = 0; i < n_layer; ++i) {
    const std::string layer = block_prefix(i);
    for (ParameterShape p : std::vector<ParameterShape>{
             {"self_attn.q_proj.weight", {n_head * hd, d}},
             {"self_attn.k_proj.weight", {n_kv_head * hd, d}},
             {"self_attn.v_proj.weight", {n_kv_head * hd, d}},
             {"self_attn.o_proj.weight", {d, n_head * hd}},
             {"mlp.gate_proj.weight", {m, d}},
             {"mlp.up_proj.weight", {m, d}},
             {"mlp.down_proj.weight", {d, m}},
             {"input_layernorm.weight", {d}},
             {"post_attention_layernorm.weight", {d}},
         }) {
      p.name = layer + p.name;
      shapes.push_back(std::move(p));
    }
  }
  shapes.push_back({"model.norm.weight", {d}});
  shapes.push_back({"lm_head.weight", {vocab_size, d}});
  return shapes;
}

std::string LlamaConfig::block_prefix(int64_t i) {
  return "model.layers." + std::to_string(i) + ".";
}

int64_t llama_intermediate_size(int64_t n_embd) {
  HP_CHECK_ARG(n_embd > 0, "llama_intermediate_size: n_embd ", n_embd, " must be positive");
  const int64_t two_thirds = 2 * (4 * n_embd) / 3;
  return (two_thirds + 31) / 32 * 32;
}

}  // namespace hp::nn
