// The Llama and its building blocks (N5): Hugging Face's parameter names,
// shapes and order; seeded initialisation and its per-parameter replay;
// hooks on the decoder layers; the rotary embedding's and RMSNorm's
// defining properties; generate(); argument validation. Parity with PyTorch
// is in llama_parity_test.cpp.
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "hp/nn/llama.h"
#include "hp/nn/rotary.h"
#include "hp/util/error.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::nn {
namespace {

LlamaConfig tiny_llama() { return test::tiny_llama_config(); }

using test::random_tokens;

TEST(Llama, NamedParametersAreHuggingFacesInOrder) {
  const LlamaConfig c = tiny_llama();
  Llama model(c);
  const int64_t V = c.vocab_size, d = c.n_embd, hd = c.head_dim(), m = c.intermediate_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"model.embed_tokens.weight", {V, d}}};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string l = "model.layers." + std::to_string(i) + ".";
    expected.insert(expected.end(), {{l + "self_attn.q_proj.weight", {c.n_head * hd, d}},
                                     {l + "self_attn.k_proj.weight", {c.n_kv_head * hd, d}},
                                     {l + "self_attn.v_proj.weight", {c.n_kv_head * hd, d}},
                                     {l + "self_attn.o_proj.weight", {d, c.n_head * hd}},
                                     {l + "mlp.gate_proj.weight", {m, d}},
                                     {l + "mlp.up_proj.weight", {m, d}},
                                     {l + "mlp.down_proj.weight", {d, m}},
                                     {l + "input_layernorm.weight", {d}},
                                     {l + "post_attention_layernorm.weight", {d}}});
  }
  expected.insert(expected.end(), {{"model.norm.weight", {d}}, {"lm_head.weight", {V, d}}});
  auto named = model->named_parameters();
  ASSERT_EQ(named.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(named[i].key(), expected[i].first);
    EXPECT_EQ(named[i].value().sizes().vec(), expected[i].second) << expected[i].first;
  }
  EXPECT_TRUE(model->named_buffers().is_empty());
  ASSERT_EQ(model->layers().size(), static_cast<size_t>(c.n_layer));
  EXPECT_EQ(model->layers()[1].ptr().get(),
            model->model->layers->ptr(1).get());  // layers() lists model.layers in order
}

// A function of the generator's starting state alone, replayable one
// parameter at a time: the weights are init_llama_parameter over
// named_parameters() in order from that state, whatever the construction drew.
TEST(Llama, InitialisationIsThePerParameterSequenceFromTheSeed) {
  const LlamaConfig c = tiny_llama();
  torch::manual_seed(7);
  Llama a(c);
  torch::manual_seed(7);
  Llama b(c);
  torch::manual_seed(7);
  std::vector<at::Tensor> replay;
  for (const auto& p : a->named_parameters()) {
    at::Tensor t = torch::empty(p.value().sizes());
    init_llama_parameter(c, p.key(), t);
    replay.push_back(t);
  }
  auto pa = a->named_parameters();
  auto pb = b->named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(test::tensors_equal(pa[i].value(), pb[i].value())) << pa[i].key();
    EXPECT_TRUE(test::tensors_equal(pa[i].value(), replay[i])) << pa[i].key();
  }
  EXPECT_TRUE(test::tensors_equal(a->model->norm->weight, torch::ones({c.n_embd})));
  // N(0, 0.02): the sample std of the 1600-element embedding within 10% of
  // it (its relative standard error is 1/sqrt(2 * 1600) = 1.8%; 10% is 5.6 of them).
  const double std = a->model->embed_tokens->weight.std().item<double>();
  EXPECT_NEAR(std, 0.02, 0.002);
  torch::manual_seed(8);
  Llama other(c);
  EXPECT_FALSE(torch::equal(other->lm_head->weight, a->lm_head->weight));
}

TEST(Llama, ForwardGivesLogitsAndCallsLayersThroughHooks) {
  const LlamaConfig c = tiny_llama();
  Llama model(c);
  std::vector<int> calls;
  for (size_t i = 0; i < model->layers().size(); ++i) {
    model->layers()[i].ptr()->register_forward_pre_hook(
        [&calls, i](Module&, const TensorList&) -> std::optional<TensorList> {
          calls.push_back(static_cast<int>(i));
          return std::nullopt;
        });
  }
  at::Tensor logits = model(random_tokens({2, 5}, c.vocab_size, 1));
  EXPECT_EQ(logits.sizes().vec(), (std::vector<int64_t>{2, 5, c.vocab_size}));
  EXPECT_EQ(calls, (std::vector<int>{0, 1}));
}

// Causality: the logits at position t depend on tokens <= t only.
TEST(Llama, IsCausal) {
  const LlamaConfig c = tiny_llama();
  Llama model(c);
  at::Tensor idx = random_tokens({1, 8}, c.vocab_size, 2);
  at::Tensor changed = idx.clone();
  changed[0][5] = (idx[0][5].item<int64_t>() + 1) % c.vocab_size;
  torch::NoGradGuard no_grad;
  at::Tensor a = model(idx), b = model(changed);
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 5), b.narrow(1, 0, 5)));
  EXPECT_FALSE(torch::equal(a.narrow(1, 5, 1), b.narrow(1, 5, 1)));
}

// The rotary embedding's defining property: the score of a query at t and a
// key at s depends on t - s only; and position 0 is not turned.
TEST(Rotary, ScoresDependOnRelativePositionOnly) {
  const int64_t hd = 8, T = 12;
  auto gen = at::detail::createCPUGenerator(3);
  at::Tensor q = torch::randn({hd}, gen, torch::kDouble);
  at::Tensor k = torch::randn({hd}, gen, torch::kDouble);
  auto [cos, sin] = rotary_tables(T, hd, 10000.0, torch::TensorOptions().dtype(torch::kDouble));
  at::Tensor qs = apply_rotary(q.expand({T, hd}), cos, sin);
  at::Tensor ks = apply_rotary(k.expand({T, hd}), cos, sin);
  EXPECT_TRUE(torch::allclose(qs[0], q, 0, 0));
  at::Tensor scores = torch::matmul(qs, ks.t());  // [t, s]
  for (int64_t off = 0; off < 4; ++off) {
    const double first = scores[off][0].item<double>();
    for (int64_t s = 1; s + off < T; ++s) {
      // cos/sin of t and s rounded once each: a few ulps of |q| |k|.
      EXPECT_NEAR(scores[s + off][s].item<double>(), first,
                  64 * 0x1p-52 * q.norm().item<double>() * k.norm().item<double>());
    }
  }
  // rotate_half pairs feature i with i + hd/2 (not 2i with 2i + 1): at
  // position 1 the first pair turns by angle 1 radian (theta^0).
  at::Tensor e0 = torch::zeros({2, hd}, torch::kDouble);
  e0.select(1, 0).fill_(1.0);
  at::Tensor turned = apply_rotary(e0, cos.narrow(0, 0, 2), sin.narrow(0, 0, 2))[1];
  EXPECT_DOUBLE_EQ(turned[0].item<double>(), std::cos(1.0));
  EXPECT_DOUBLE_EQ(turned[hd / 2].item<double>(), std::sin(1.0));
}

TEST(RMSNorm, NormalisesByRootMeanSquare) {
  RMSNorm norm(4, 1e-6);
  at::Tensor x = torch::tensor({{3.0, -4.0, 0.0, 0.0}}, torch::kDouble);
  norm->to(torch::kDouble);
  const double rms = std::sqrt(25.0 / 4 + 1e-6);
  EXPECT_TRUE(torch::allclose(norm(x), x / rms, 1e-15, 0));
}

TEST(Llama, GenerateAppendsTokens) {
  const LlamaConfig c = tiny_llama();
  Llama model(c);
  at::Generator g1 = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Generator g2 = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor prompt = random_tokens({1, 3}, c.vocab_size, 4);
  at::Tensor a = model->generate(prompt, 20, 1.0, 5, g1);  // beyond context 16
  at::Tensor b = model->generate(prompt, 20, 1.0, 5, g2);
  EXPECT_EQ(a.sizes().vec(), (std::vector<int64_t>{1, 23}));
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(a.narrow(1, 0, 3), prompt));
}

TEST(Llama, RejectsBadConfigAndInput) {
  LlamaConfig c = tiny_llama();
  c.n_kv_head = 3;
  EXPECT_THAT([&] { Llama m(c); },
              ::testing::ThrowsMessage<ArgumentError>(::testing::HasSubstr(
                  "LlamaConfig.n_head 4 must be divisible by n_kv_head 3")));
  c = tiny_llama();
  c.n_embd = 36;  // head dim 9
  EXPECT_THROW(Llama m(c), ArgumentError);
  c = tiny_llama();
  Llama model(c);
  EXPECT_THAT([&] { model(random_tokens({1, 17}, c.vocab_size, 1)); },
              ::testing::ThrowsMessage<ArgumentError>(
                  ::testing::HasSubstr("sequence length 17 exceeds config.context 16")));
  EXPECT_THAT([&] { model(torch::full({1, 2}, c.vocab_size, torch::kLong)); },
              ::testing::ThrowsMessage<ArgumentError>(
                  ::testing::HasSubstr("token ids must be in [0, 50) but got 50")));
  EXPECT_THROW(model(torch::zeros({1, 2}, torch::kInt)), ArgumentError);
}

}  // namespace
}  // namespace hp::nn
