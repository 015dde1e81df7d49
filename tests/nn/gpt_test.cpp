// The GPT and its building blocks (N2, N3): parameter names, shapes and
// order; seeded initialisation; hooks on blocks and root; generate();
// cross-entropy; dropout; argument validation. Parity with PyTorch is in
// gpt_parity_test.cpp.
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/error.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::nn {
namespace {

using ::testing::StrEq;
using ::testing::ThrowsMessage;

GPTConfig small_config() { return test::tiny_gpt_config(); }

GPT seeded_gpt(const GPTConfig& config, uint64_t seed) {
  torch::manual_seed(seed);
  return GPT(config);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> expected_parameters(const GPTConfig& c) {
  const int64_t V = c.vocab_size, C = c.context, d = c.n_embd;
  std::vector<std::pair<std::string, std::vector<int64_t>>> p = {{"wte.weight", {V, d}},
                                                                 {"wpe.weight", {C, d}}};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    p.insert(p.end(), {{h + "ln_1.weight", {d}},
                       {h + "ln_1.bias", {d}},
                       {h + "attn.c_attn.weight", {3 * d, d}},
                       {h + "attn.c_attn.bias", {3 * d}},
                       {h + "attn.c_proj.weight", {d, d}},
                       {h + "attn.c_proj.bias", {d}},
                       {h + "ln_2.weight", {d}},
                       {h + "ln_2.bias", {d}},
                       {h + "mlp.c_fc.weight", {4 * d, d}},
                       {h + "mlp.c_fc.bias", {4 * d}},
                       {h + "mlp.c_proj.weight", {d, 4 * d}},
                       {h + "mlp.c_proj.bias", {d}}});
  }
  p.insert(p.end(), {{"ln_f.weight", {d}}, {"ln_f.bias", {d}}, {"lm_head.weight", {V, d}}});
  return p;
}

using test::random_tokens;

TEST(GPT, NamedParametersAreGPT2sInOrder) {
  const GPTConfig c = small_config();
  GPT model(c);
  const auto expected = expected_parameters(c);
  auto named = model->named_parameters();
  ASSERT_EQ(named.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(named[i].key(), expected[i].first);
    EXPECT_EQ(named[i].value().sizes().vec(), expected[i].second) << expected[i].first;
  }
  // Parameters only: no buffers (a causal mask is computed, not registered).
  EXPECT_TRUE(model->named_buffers().is_empty());

  const int64_t V = c.vocab_size, d = c.n_embd;
  const int64_t count = 2 * V * d + c.context * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d;
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  EXPECT_EQ(numel, count);

  // lm_head is its own parameter, not wte's.
  EXPECT_NE(model->lm_head->weight.data_ptr(), model->wte->weight.data_ptr());
  ASSERT_EQ(model->blocks().size(), 2u);
  EXPECT_TRUE(model->blocks()[1].ptr() == model->h[1]);
}

TEST(GPT, ParameterOrderIsStableAcrossCallsAndTraining) {
  GPT model(small_config());
  auto before = model->parameters();
  auto idx = random_tokens({2, 8}, 50, 1);
  cross_entropy(model(idx), random_tokens({2, 8}, 50, 2)).backward();
  auto after = model->parameters();
  auto named = model->named_parameters();
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(before[i].is_same(after[i]));
    EXPECT_TRUE(before[i].is_same(named[i].value()));
    EXPECT_TRUE(after[i].grad().defined()) << named[i].key();
  }
}

TEST(GPT, InitialisationIsSeededAndGPT2Shaped) {
  const GPTConfig c = small_config();
  GPT a = seeded_gpt(c, 7), b = seeded_gpt(c, 7), other = seeded_gpt(c, 8);
  auto pa = a->named_parameters(), pb = b->named_parameters(), po = other->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(test::tensors_equal(pa[i].value(), pb[i].value())) << pa[i].key();
  }
  EXPECT_FALSE(pa["wte.weight"].equal(po["wte.weight"]));
  EXPECT_FALSE(pa["h.1.mlp.c_proj.weight"].equal(po["h.1.mlp.c_proj.weight"]));

  for (const auto& p : pa) {
    const std::string& name = p.key();
    const at::Tensor& t = p.value();
    const bool layer_norm = name.find("ln_") != std::string::npos;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0) {
      EXPECT_TRUE(test::tensors_equal(t, torch::zeros_like(t))) << name;
    } else if (layer_norm) {
      EXPECT_TRUE(test::tensors_equal(t, torch::ones_like(t))) << name;
    } else {
      const bool proj = name.find("c_proj.weight") != std::string::npos;
      const double expected_std = proj ? 0.02 / std::sqrt(2.0 * c.n_layer) : 0.02;
      EXPECT_NEAR(t.std().item<double>(), expected_std, 0.1 * expected_std) << name;
      EXPECT_NEAR(t.mean().item<double>(), 0.0, 0.1 * expected_std) << name;
    }
  }
}

TEST(GPT, ForwardShapesAndCausality) {
  const GPTConfig c = small_config();
  GPT model = seeded_gpt(c, 3);
  auto idx = random_tokens({3, 10}, c.vocab_size, 4);
  at::Tensor logits = model(idx);
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{3, 10, c.vocab_size}));
  // Changing the last token leaves the logits of earlier positions unchanged.
  at::Tensor changed = idx.clone();
  changed.select(1, 9).copy_(idx.select(1, 9).add(1).remainder(c.vocab_size));
  at::Tensor again = model(changed);
  EXPECT_TRUE(test::tensors_equal(again.narrow(1, 0, 9), logits.narrow(1, 0, 9)));
  EXPECT_FALSE(again.select(1, 9).equal(logits.select(1, 9)));
}

TEST(GPT, HooksOnBlocksAndRootFireInForwardOrder) {
  GPT model(small_config());
  std::vector<std::string> events;
  // Records "pre <name>" and "post <name>" around m's forward.
  auto hook = [&events](Module& m, const std::string& name) {
    m.register_forward_pre_hook([&events, name](Module&, const TensorList&) {
      events.push_back("pre " + name);
      return std::optional<TensorList>();
    });
    m.register_forward_hook([&events, name](Module&, const TensorList&, const TensorList&) {
      events.push_back("post " + name);
      return std::optional<TensorList>();
    });
  };
  hook(*model, "root");
  for (size_t i = 0; i < model->blocks().size(); ++i) {
    Block block = model->blocks()[i];  // holders share their module: a copy is a handle
    hook(*block, "h." + std::to_string(i));
    hook(*block->attn, "h." + std::to_string(i) + ".attn");
    hook(*block->mlp, "h." + std::to_string(i) + ".mlp");
  }
  model(random_tokens({1, 4}, 50, 5));
  EXPECT_EQ(events, (std::vector<std::string>{
                        "pre root", "pre h.0", "pre h.0.attn", "post h.0.attn", "pre h.0.mlp",
                        "post h.0.mlp", "post h.0", "pre h.1", "pre h.1.attn", "post h.1.attn",
                        "pre h.1.mlp", "post h.1.mlp", "post h.1", "post root"}));

  // A block's hook can replace its output, and the model uses the replacement.
  at::Tensor idx = random_tokens({1, 4}, 50, 6);
  at::Tensor plain = model(idx);
  Block last = model->blocks()[1];
  last->register_forward_hook(
      [](Module&, const TensorList&, const TensorList& out) -> std::optional<TensorList> {
        return TensorList{out[0] * 2};
      });
  EXPECT_FALSE(model(idx).equal(plain));
}

TEST(GPT, GenerateIsSeededAndCropsTheContext) {
  const GPTConfig c = small_config();
  GPT model = seeded_gpt(c, 11);
  model->eval();
  at::Tensor prompt = random_tokens({2, 5}, c.vocab_size, 12);

  int root_calls = 0;
  model->register_forward_pre_hook([&](Module&, const TensorList& in) -> std::optional<TensorList> {
    ++root_calls;
    EXPECT_LE(in[0].size(1), c.context);
    return std::nullopt;
  });
  // 5 + 20 tokens run past the 16-token context: each step must crop.
  at::Tensor a = model->generate(prompt, 20, 0.8, 10, at::detail::createCPUGenerator(42));
  EXPECT_EQ(root_calls, 20);  // forward goes through the root's hooks
  at::Tensor b = model->generate(prompt, 20, 0.8, 10, at::detail::createCPUGenerator(42));
  at::Tensor other = model->generate(prompt, 20, 0.8, 10, at::detail::createCPUGenerator(43));
  EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{2, 25}));
  EXPECT_TRUE(test::tensors_equal(a, b));
  EXPECT_FALSE(a.equal(other));
  EXPECT_TRUE(test::tensors_equal(a.narrow(1, 0, 5), prompt));
  EXPECT_GE(a.min().item<int64_t>(), 0);
  EXPECT_LT(a.max().item<int64_t>(), c.vocab_size);
  EXPECT_FALSE(a.requires_grad());

  // Greedy (top_k = 1) picks the argmax; a prompt longer than the context
  // continues exactly as its last `context` tokens do.
  at::Tensor long_prompt = random_tokens({2, 20}, c.vocab_size, 13);
  at::Tensor tail = long_prompt.narrow(1, 4, 16);
  at::Tensor greedy_long =
      model->generate(long_prompt, 3, 1.0, 1, at::detail::createCPUGenerator(1));
  at::Tensor greedy_tail = model->generate(tail, 3, 1.0, 1, at::detail::createCPUGenerator(2));
  EXPECT_TRUE(test::tensors_equal(greedy_long.narrow(1, 20, 3), greedy_tail.narrow(1, 16, 3)));
  torch::NoGradGuard no_grad;
  at::Tensor argmax = model->forward(tail).select(1, -1).argmax(-1);
  EXPECT_TRUE(test::tensors_equal(greedy_tail.select(1, 16), argmax));
  EXPECT_TRUE(test::tensors_equal(model->generate(prompt, 0, 1.0, 0, at::Generator()), prompt));
}

TEST(GPT, CrossEntropyIsTheMeanOverAllTokens) {
  at::Tensor logits = torch::randn({2, 3, 7});
  at::Tensor targets = random_tokens({2, 3}, 7, 9);
  at::Tensor expected =
      -logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1).mean();
  EXPECT_TRUE(test::tensors_close(cross_entropy(logits, targets), expected, 1e-6, 1e-6));
}

TEST(GPT, DropoutOnlyInTraining) {
  GPTConfig c = small_config();
  c.dropout = 0.5;
  GPT dropped = seeded_gpt(c, 5);
  c.dropout = 0.0;
  GPT plain = seeded_gpt(c, 5);
  at::Tensor idx = random_tokens({2, 8}, c.vocab_size, 6);
  dropped->eval();
  EXPECT_TRUE(test::tensors_equal(dropped(idx), plain(idx)));
  dropped->train();
  EXPECT_FALSE(dropped(idx).equal(plain(idx)));
}

TEST(GPT, ConfigValidation) {
  auto message = [](auto mutate) {
    GPTConfig c = small_config();
    mutate(c);
    return [c] { GPT model(c); };
  };
  EXPECT_THAT(
      message([](GPTConfig& c) { c.n_embd = 65; }),
      ThrowsMessage<ArgumentError>(StrEq("GPTConfig.n_embd 65 must be divisible by n_head 4")));
  EXPECT_THAT(message([](GPTConfig& c) { c.vocab_size = 0; }),
              ThrowsMessage<ArgumentError>(StrEq("GPTConfig.vocab_size 0 must be positive")));
  EXPECT_THAT(message([](GPTConfig& c) { c.context = -1; }),
              ThrowsMessage<ArgumentError>(StrEq("GPTConfig.context -1 must be positive")));
  EXPECT_THAT(message([](GPTConfig& c) { c.n_layer = 0; }),
              ThrowsMessage<ArgumentError>(StrEq("GPTConfig.n_layer 0 must be positive")));
  EXPECT_THAT(message([](GPTConfig& c) { c.n_head = 0; }),
              ThrowsMessage<ArgumentError>(StrEq("GPTConfig.n_head 0 must be positive")));
  EXPECT_THAT(message([](GPTConfig& c) { c.n_embd = 0; }),
              ThrowsMessage<ArgumentError>(StrEq("GPTConfig.n_embd 0 must be positive")));
  EXPECT_THAT(message([](GPTConfig& c) { c.dropout = 1.0; }),
              ThrowsMessage<ArgumentError>(StrEq("GPTConfig.dropout 1 must be in [0, 1)")));
}

TEST(GPT, InputValidation) {
  GPTConfig c = small_config();
  c.context = 128;
  GPT model(c);
  auto forward_error = [&](const at::Tensor& idx) {
    return [&model, idx] { model(idx); };
  };
  EXPECT_THAT(forward_error(torch::zeros({1, 200}, torch::kLong)),
              ThrowsMessage<ArgumentError>(
                  StrEq("GPT.forward: sequence length 200 exceeds config.context 128")));
  EXPECT_THAT(forward_error(torch::zeros({1, 4}, torch::kInt)),
              ThrowsMessage<ArgumentError>(StrEq(
                  "GPT.forward: idx must be an int64 [B, T] tensor but got Int of shape [1, 4]")));
  EXPECT_THAT(forward_error(torch::zeros({4}, torch::kLong)),
              ThrowsMessage<ArgumentError>(StrEq(
                  "GPT.forward: idx must be an int64 [B, T] tensor but got Long of shape [4]")));
  EXPECT_THAT(
      forward_error(torch::zeros({1, 0}, torch::kLong)),
      ThrowsMessage<ArgumentError>(StrEq("GPT.forward: sequence length 0 must be at least 1")));
  EXPECT_THAT(
      forward_error(torch::full({1, 3}, 50, torch::kLong)),
      ThrowsMessage<ArgumentError>(StrEq("GPT.forward: token ids must be in [0, 50) but got 50")));
  EXPECT_THAT(
      forward_error(torch::full({1, 3}, -1, torch::kLong)),
      ThrowsMessage<ArgumentError>(StrEq("GPT.forward: token ids must be in [0, 50) but got -1")));

  auto gen = at::detail::createCPUGenerator(0);
  auto generate_error = [&](at::Tensor idx, int64_t n, double temperature, int64_t top_k) {
    return [&model, &gen, idx, n, temperature, top_k] {
      model->generate(idx, n, temperature, top_k, gen);
    };
  };
  at::Tensor prompt = torch::zeros({1, 2}, torch::kLong);
  EXPECT_THAT(
      generate_error(prompt, -1, 1.0, 0),
      ThrowsMessage<ArgumentError>(StrEq("GPT.generate: max_new_tokens -1 must be non-negative")));
  EXPECT_THAT(generate_error(prompt, 1, 0.0, 0),
              ThrowsMessage<ArgumentError>(
                  StrEq("GPT.generate: temperature 0 must be positive and finite")));
  EXPECT_THAT(
      generate_error(prompt, 1, 1.0, -2),
      ThrowsMessage<ArgumentError>(StrEq("GPT.generate: top_k -2 must be non-negative (0 = off)")));
  EXPECT_THAT(
      generate_error(torch::zeros({1, 0}, torch::kLong), 1, 1.0, 0),
      ThrowsMessage<ArgumentError>(StrEq("GPT.generate: idx must be an int64 [B, T0] tensor with "
                                         "T0 >= 1 but got Long of shape [1, 0]")));

  at::Tensor logits = torch::zeros({2, 3, 5});
  auto loss_error = [&](const at::Tensor& l, const at::Tensor& t) {
    return [l, t] { cross_entropy(l, t); };
  };
  EXPECT_THAT(
      loss_error(logits, torch::zeros({2, 4}, torch::kLong)),
      ThrowsMessage<ArgumentError>(StrEq("cross_entropy: targets must be int64 [2, 3] to match "
                                         "logits [2, 3, 5] but got Long of shape [2, 4]")));
  EXPECT_THAT(
      loss_error(logits, torch::zeros({2, 3}, torch::kInt)),
      ThrowsMessage<ArgumentError>(StrEq("cross_entropy: targets must be int64 [2, 3] to match "
                                         "logits [2, 3, 5] but got Int of shape [2, 3]")));
  EXPECT_THAT(loss_error(torch::zeros({6, 5}), torch::zeros({6}, torch::kLong)),
              ThrowsMessage<ArgumentError>(StrEq("cross_entropy: logits must be a floating [B, T, "
                                                 "V] tensor but got Float of shape [6, 5]")));
  EXPECT_THAT(
      loss_error(logits, torch::full({2, 3}, 5, torch::kLong)),
      ThrowsMessage<ArgumentError>(StrEq("cross_entropy: targets must be in [0, 5) but got 5")));

  CausalSelfAttention attn(c);
  EXPECT_THAT([&] { attn(torch::zeros({2, 3, 31})); },
              ThrowsMessage<ArgumentError>(
                  StrEq("CausalSelfAttention.forward: x of shape [2, 3, 31] must be [B, T, 32]")));
}

}  // namespace
}  // namespace hp::nn
