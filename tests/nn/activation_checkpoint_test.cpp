// Activation checkpointing (N4) in one process: a GPT whose blocks are
// checkpointed computes the same loss and gradients, bit for bit, as the
// same GPT without, with dropout off and on (the recomputation replays the
// generator), for several AdamW steps; the generators continue as without
// checkpointing; parameters reached only through the checkpointed body get
// gradients; errors name the module.
#include "hp/nn/activation_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/error.h"
#include "tests/support/model_configs.h"

namespace hp::nn {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

GPTConfig config(double dropout) {
  GPTConfig c = test::gpt_config(
      {/*vocab=*/40, /*context=*/16, /*layers=*/3, /*heads=*/4, /*width=*/32});
  c.dropout = dropout;
  return c;
}

GPT make_gpt(double dropout, bool checkpointed) {
  torch::manual_seed(11);
  GPT model(config(dropout));
  if (checkpointed) {
    for (const Block& block : model->blocks()) set_activation_checkpointing(*block.ptr());
  }
  return model;
}

at::Tensor tokens(int step) {
  at::Generator gen = at::detail::createCPUGenerator(500 + step);
  return at::randint(0, 40, {4, 13}, gen, at::kLong);
}

// One training step with the default generator seeded alike for both
// models; returns the loss.
at::Tensor train_step(GPT& model, torch::optim::AdamW& opt, int step) {
  opt.zero_grad();
  torch::manual_seed(1000 + step);
  at::Tensor t = tokens(step);
  at::Tensor loss = cross_entropy(model(t.narrow(1, 0, 12)), t.narrow(1, 1, 12));
  loss.backward();
  return loss.detach();
}

class ActivationCheckpointing : public ::testing::TestWithParam<double> {};

TEST_P(ActivationCheckpointing, GPTGradientsAndLossesBitwiseEqual) {
  const double dropout = GetParam();
  GPT plain = make_gpt(dropout, false);
  GPT checkpointed = make_gpt(dropout, true);
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW ckpt_opt(checkpointed->parameters(), torch::optim::AdamWOptions(1e-2));
  auto plain_params = plain->named_parameters();
  auto ckpt_params = checkpointed->named_parameters();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor plain_loss = train_step(plain, plain_opt, step);
    const double plain_next = torch::rand({1}).item<double>();
    at::Tensor ckpt_loss = train_step(checkpointed, ckpt_opt, step);
    // The recomputation put the generator back where forward left it.
    EXPECT_EQ(torch::rand({1}).item<double>(), plain_next);
    EXPECT_TRUE(torch::equal(plain_loss, ckpt_loss))
        << plain_loss.item<double>() << " vs " << ckpt_loss.item<double>();
    for (const auto& p : plain_params) {
      const at::Tensor& g = ckpt_params[p.key()].grad();
      ASSERT_TRUE(g.defined()) << p.key();
      EXPECT_TRUE(torch::equal(p.value().grad(), g)) << p.key();
    }
    plain_opt.step();
    ckpt_opt.step();
  }
}

INSTANTIATE_TEST_SUITE_P(Dropout, ActivationCheckpointing, ::testing::Values(0.0, 0.2),
                         [](const auto& info) { return info.param > 0 ? "On" : "Off"; });

TEST(ActivationCheckpointingDropout, MasksDifferWithoutReplay) {
  // The bitwise test above proves the replay only if dropout draws fresh
  // masks per call: two forwards of one model from different states differ.
  GPT model = make_gpt(0.2, true);
  at::Tensor t = tokens(0).narrow(1, 0, 12);
  torch::manual_seed(1);
  at::Tensor a = model(t);
  at::Tensor b = model(t);
  EXPECT_FALSE(torch::equal(a, b));
}

TEST(ActivationCheckpointingFunction, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(3);
  torch::nn::Linear linear(4, 3);
  at::Tensor x = torch::randn({2, 4});  // requires no grad
  auto body = [&](TensorList& in) { return TensorList{torch::tanh(linear(in[0]))}; };
  TensorList out = checkpointed(body, {x});
  ASSERT_TRUE(out[0].requires_grad());
  out[0].sum().backward();
  at::Tensor ckpt_grad = linear->weight.grad().clone();
  linear->weight.mutable_grad() = at::Tensor();
  torch::tanh(linear(x)).sum().backward();
  EXPECT_TRUE(torch::equal(linear->weight.grad(), ckpt_grad));
}

TEST(ActivationCheckpointingFunction, InputGradientsFlowAndUnusedOutputsAreFine) {
  torch::manual_seed(4);
  at::Tensor a = torch::randn({3}, torch::requires_grad());
  at::Tensor b = torch::randn({3}, torch::requires_grad());
  auto body = [](TensorList& in) { return TensorList{in[0] * in[1], in[0].exp()}; };
  TensorList out = checkpointed(body, {a, b});
  out[0].sum().backward();  // the second output takes no part
  at::Tensor ga = a.grad().clone(), gb = b.grad().clone();
  EXPECT_TRUE(torch::equal(ga, b.detach()));
  EXPECT_TRUE(torch::equal(gb, a.detach()));
}

TEST(ActivationCheckpointingFunction, WithoutGradModeRunsPlainly) {
  torch::manual_seed(5);
  GPT model = make_gpt(0.0, true);
  at::Tensor t = tokens(1).narrow(1, 0, 12);
  torch::NoGradGuard no_grad;
  at::Tensor logits = model(t);
  EXPECT_FALSE(logits.requires_grad());
  EXPECT_TRUE(torch::equal(logits, make_gpt(0.0, false)(t)));
}

TEST(ActivationCheckpointingModule, SwitchesOnAndOff) {
  GPT model = make_gpt(0.0, false);
  Block block = model->blocks()[0];
  EXPECT_FALSE(is_activation_checkpointed(*block.ptr()));
  set_activation_checkpointing(*block.ptr());
  set_activation_checkpointing(*block.ptr());  // idempotent
  EXPECT_TRUE(is_activation_checkpointed(*block.ptr()));
  at::Tensor x = torch::randn({2, 5, 32}, torch::requires_grad());
  EXPECT_THAT(block(x).grad_fn()->name(), HasSubstr("CheckpointFunction"));
  set_activation_checkpointing(*block.ptr(), false);
  EXPECT_FALSE(is_activation_checkpointed(*block.ptr()));
  EXPECT_FALSE(block.ptr()->has_forward_hooks());
  EXPECT_THAT(block(x).grad_fn()->name(), ::testing::Not(HasSubstr("CheckpointFunction")));
}

TEST(ActivationCheckpointingModule, RefusesAnotherWrapper) {
  GPT model = make_gpt(0.0, false);
  Block block = model->blocks()[1];
  block.ptr()->set_forward_wrapper(
      [](Module&, TensorList& in, const ForwardBody& body) { return body(in); });
  EXPECT_THAT([&] { set_activation_checkpointing(*block.ptr()); },
              ThrowsMessage<ArgumentError>(HasSubstr("Block already has another forward wrapper")));
}

TEST(ActivationCheckpointingModule, ErrorInTheRecomputationReachesBackward) {
  GPT model = make_gpt(0.0, true);
  Block block = model->blocks()[0];
  bool fail = false;
  block->mlp->register_forward_pre_hook(
      [&](Module&, const TensorList&) -> std::optional<TensorList> {
        if (fail) throw std::runtime_error("mlp refuses to run again");
        return std::nullopt;
      });
  at::Tensor t = tokens(2);
  at::Tensor loss = cross_entropy(model(t.narrow(1, 0, 12)), t.narrow(1, 1, 12));
  fail = true;
  auto next_draw = [] {
    at::Generator copy = at::detail::getDefaultCPUGenerator().clone();
    return torch::rand({1}, copy).item<double>();
  };
  const double next = next_draw();
  EXPECT_THAT([&] { loss.backward(); },
              ThrowsMessage<std::runtime_error>(HasSubstr("mlp refuses to run again")));
  // The generator is where it was before the failed recomputation.
  EXPECT_EQ(next_draw(), next);
}

}  // namespace
}  // namespace hp::nn
