// GPTConfig::parameter_shapes() and LlamaConfig::parameter_shapes() list the
// built model's named_parameters(), names, shapes and order: the memory plan
// (P2) reads them instead of a copy of its own.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "hp/nn/gpt.h"
#include "hp/nn/llama.h"
#include "hp/nn/parameter_shape.h"
#include "tests/support/model_configs.h"

namespace hp::nn {
namespace {

using NamedShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

NamedShapes of_model(const torch::nn::Module& model) {
  NamedShapes out;
  for (const auto& item : model.named_parameters()) {
    out.emplace_back(item.key(), item.value().sizes().vec());
  }
  return out;
}

NamedShapes of_config(const std::vector<ParameterShape>& shapes) {
  NamedShapes out;
  for (const auto& p : shapes) out.emplace_back(p.name, p.shape);
  return out;
}

TEST(ParameterShapes, GPTConfigListsTheBuiltGPTsParameters) {
  const GPTConfig c =
      test::gpt_config({/*vocab=*/50, /*context=*/12, /*layers=*/3, /*heads=*/2, /*width=*/8});
  GPT model(c, at::kMeta);  // shapes only
  EXPECT_EQ(of_config(c.parameter_shapes()), of_model(*model));
  EXPECT_EQ(GPTConfig::block_prefix(2), "h.2.");
}

TEST(ParameterShapes, LlamaConfigListsTheBuiltLlamasParameters) {
  LlamaConfig c;
  c.vocab_size = 50;
  c.context = 12;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_kv_head = 2;  // grouped-query: k and v narrower than q
  c.n_embd = 16;
  c.intermediate_size = 24;
  Llama model(c, at::kMeta);
  EXPECT_EQ(of_config(c.parameter_shapes()), of_model(*model));
  EXPECT_EQ(LlamaConfig::block_prefix(2), "model.layers.2.");
}

}  // namespace
}  // namespace hp::nn
