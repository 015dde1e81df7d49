// The GPT shapes the tests build, in one place: a test names the shape it
// needs (or states an unusual one in a line) instead of setting a GPTConfig
// field by field.
#pragma once

#include <cstdint>

#include "hp/nn/gpt_config.h"
#include "hp/nn/llama_config.h"

namespace hp::test {

struct GptShape {
  int64_t vocab = 0;
  int64_t context = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t width = 0;  // n_embd
};

inline nn::GPTConfig gpt_config(const GptShape& shape) {
  nn::GPTConfig c;
  c.vocab_size = shape.vocab;
  c.context = shape.context;
  c.n_layer = shape.layers;
  c.n_head = shape.heads;
  c.n_embd = shape.width;
  return c;
}

// The model tests' GPT (one process): 2 layers of width 32, 4 heads.
inline nn::GPTConfig tiny_gpt_config() {
  return gpt_config({/*vocab=*/50, /*context=*/16, /*layers=*/2, /*heads=*/4, /*width=*/32});
}

// The fully_shard parity tests' GPT: width 64 over 4 heads, so every
// parameter splits unevenly over 3 ranks somewhere (vocabulary 50).
inline nn::GPTConfig small_gpt_config(int64_t layers = 2) {
  return gpt_config({/*vocab=*/50, /*context=*/16, layers, /*heads=*/4, /*width=*/64});
}

// Tensor parallelism's GPT: 12 heads divide by 2, 3 and 4 ranks; the
// vocabulary (50) does not (uneven shards).
inline nn::GPTConfig tp_small_config() {
  return gpt_config({/*vocab=*/50, /*context=*/8, /*layers=*/2, /*heads=*/12, /*width=*/48});
}

// hp-train's GPT as its tests run it (--layers 2 --d 32 --heads 2 --ctx 16)
// on the fortunes corpus (256 byte values).
inline nn::GPTConfig byte_gpt_config() {
  return gpt_config({/*vocab=*/256, /*context=*/16, /*layers=*/2, /*heads=*/2, /*width=*/32});
}

// The small Llama of the model, meta-init and parity tests: 4 heads over 2
// key/value heads (grouped-query attention), width 32, SwiGLU width 88.
inline nn::LlamaConfig tiny_llama_config(int64_t vocab = 50) {
  nn::LlamaConfig c;
  c.vocab_size = vocab;
  c.context = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 32;
  c.intermediate_size = 88;
  return c;
}

}  // namespace hp::test
