// A small residual MLP for fully_shard tests: uneven layer sizes (padding),
// hookable blocks that become units, and a root that keeps parameters of
// its own. Built from a seed so every rank and the single-process reference
// start from the same weights.
#pragma once

#include <torch/torch.h>

#include "hp/nn/module.h"

namespace hp::test {

struct ToyBlockImpl : nn::Module {
  ToyBlockImpl(int64_t d, int64_t hidden) : nn::Module("ToyBlock") {
    fc1 = register_module("fc1", torch::nn::Linear(d, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, d));
  }
  at::Tensor forward(const at::Tensor& x) { return x + fc2(torch::gelu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
HP_MODULE(ToyBlock);

struct ToyModelImpl : nn::Module {
  ToyModelImpl(int64_t in, int64_t d, int64_t hidden, int64_t out, int64_t layers)
      : nn::Module("ToyModel") {
    embed = register_module("embed", torch::nn::Linear(in, d));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
      ToyBlock b(d, hidden);
      blocks->push_back(b);
      block_list.push_back(b);
    }
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(d, out).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = embed(x);
    for (auto& b : block_list) h = b(h);
    return head(h);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<ToyBlock> block_list;
};
HP_MODULE(ToyModel);

// in 6 -> d 10 -> hidden 14 -> out 5: no size divides by 3 or 4.
inline ToyModel make_toy_model(int64_t layers = 3, uint64_t seed = 1234) {
  torch::manual_seed(seed);
  return ToyModel(6, 10, 14, 5, layers);
}

}  // namespace hp::test
