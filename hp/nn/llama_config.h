// The shape of a Llama-family model (N5 in docs/features.md).
//
// Field names follow the GPT's (hp/nn/gpt_config.h) where the meaning is the
// same; Hugging Face's LlamaConfig names are given beside each field.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/nn/parameter_shape.h"

namespace hp::nn {

struct LlamaConfig {
  int64_t vocab_size = 256;         // vocab_size
  int64_t context = 128;            // max_position_embeddings: longest sequence forward accepts
  int64_t n_layer = 2;              // num_hidden_layers
  int64_t n_head = 4;               // num_attention_heads
  int64_t n_kv_head = 4;            // num_key_value_heads: grouped-query attention when < n_head
  int64_t n_embd = 64;              // hidden_size
  int64_t intermediate_size = 192;  // intermediate_size: width of the SwiGLU MLP
  double rms_norm_eps = 1e-6;       // rms_norm_eps
  double rope_theta = 10000.0;      // rope_theta
  double initializer_range = 0.02;  // initializer_range: std of every Linear and Embedding

  int64_t head_dim() const { return n_embd / n_head; }

  // Throws hp::ArgumentError naming the field, its value and the
  // expectation, e.g. "LlamaConfig.n_head 4 must be divisible by n_kv_head 3".
  void validate() const;

  // Every parameter of the Llama this config builds (hp/nn/llama.h), in
  // named_parameters() order: the embedding, each decoder layer
  // model.layers.<i>, the final norm, lm_head.
  std::vector<ParameterShape> parameter_shapes() const;
  // The name prefix of decoder layer i's parameters: "model.layers.<i>.".
  static std::string block_prefix(int64_t i);
};

// The MLP width hp-train gives a Llama of hidden size `n_embd`: Meta's rule,
// 2/3 of 4 n_embd rounded up to a multiple of 32 (n_embd 64 -> 192).
int64_t llama_intermediate_size(int64_t n_embd);

}  // namespace hp::nn
