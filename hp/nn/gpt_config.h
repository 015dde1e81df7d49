// The shape of a GPT-2 style model (N2 in docs/features.md).
//
// One struct shared by the model and its building blocks, so that a block
// built on its own (e.g. by a test or a sharding plan) has the same
// dimensions as the blocks inside a GPT.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/nn/parameter_shape.h"

namespace hp::nn {

struct GPTConfig {
  int64_t vocab_size = 256;
  int64_t context = 128;  // longest sequence forward accepts (GPT-2's block size)
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_embd = 64;
  double dropout = 0.0;  // applied only when > 0 and the module is training

  int64_t head_dim() const { return n_embd / n_head; }

  // Throws hp::ArgumentError naming the field, its value and the
  // expectation, e.g. "GPTConfig.n_embd 65 must be divisible by n_head 4".
  void validate() const;

  // Every parameter of the GPT this config builds (hp/nn/gpt.h), in
  // named_parameters() order: wte, wpe, each block h.<i>, ln_f, lm_head.
  std::vector<ParameterShape> parameter_shapes() const;
  // The name prefix of block i's parameters: "h.<i>.".
  static std::string block_prefix(int64_t i);
};

}  // namespace hp::nn
