// The input / weight split of a stage's backward (hp/pp/split_backward.h).
#include "hp/pp/split_backward.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/pp/stage_module.h"
#include "hp/util/error.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::pp {
namespace {

std::vector<at::Tensor> params_of(const torch::nn::Module& m) { return m.parameters(); }

struct Grads {
  at::Tensor input;
  std::map<std::string, at::Tensor> params;
};

Grads grads_of(const torch::nn::Module& m, const at::Tensor& input) {
  Grads g;
  if (input.defined()) g.input = input.grad().clone();
  for (const auto& item : m.named_parameters())
    g.params[item.key()] =
        item.value().grad().defined() ? item.value().grad().clone() : at::Tensor();
  return g;
}

// I then W gives what one backward gives, bit for bit: every node runs the
// same formula on the same gradients, each parameter's gradient is made by
// one node, and the input's gradient sums its contributions in the engine's
// order both times.
void expect_split_equals_full(StageModule stage, const at::Tensor& stage_input, bool is_last,
                              const at::Tensor& targets) {
  auto run = [&](bool split) {
    stage->zero_grad();
    at::Tensor input = stage_input;
    if (input.is_floating_point()) input = stage_input.detach().clone().requires_grad_(true);
    at::Tensor out = stage(input);
    at::Tensor grad;
    if (is_last) {
      out = nn::cross_entropy(out, targets) / 3;
      grad = at::ones_like(out);
    } else {
      grad = at::linspace(-1, 1, out.numel()).view(out.sizes());
    }
    if (!split) {
      torch::autograd::backward({out}, {grad});
      return grads_of(*stage, input.is_floating_point() ? input : at::Tensor());
    }
    SplitBackward backward(out, input.is_floating_point() ? input : at::Tensor(),
                           params_of(*stage));
    at::Tensor grad_input = backward.backward_input(grad);
    // After I, no parameter has a gradient yet (outside checkpointed blocks).
    bool any = false;
    for (const auto& p : stage->parameters()) any = any || p.grad().defined();
    EXPECT_FALSE(any && !stage->blocks().front()->has_forward_wrapper())
        << "I accumulated weight gradients";
    backward.backward_weight();
    Grads g = grads_of(*stage, at::Tensor());
    g.input = grad_input;
    return g;
  };
  Grads full = run(false), split = run(true);
  if (full.input.defined()) {
    EXPECT_TRUE(test::tensors_equal(split.input, full.input));
  }
  for (const auto& [name, g] : full.params) {
    ASSERT_TRUE(g.defined()) << name;
    EXPECT_TRUE(test::tensors_equal(split.params.at(name), g)) << name;
  }
}

TEST(SplitBackward, InputThenWeightEqualsOneBackwardOnEveryKindOfStage) {
  const nn::GPTConfig config = test::small_gpt_config(/*layers=*/3);
  torch::manual_seed(5);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 3);
  const at::Tensor ids = test::random_tokens({2, 8}, config.vocab_size, 7);
  const at::Tensor hidden = at::randn({2, 8, config.n_embd});
  expect_split_equals_full(gpt_stage(*whole, plan, 0), ids, false, {});     // no input gradient
  expect_split_equals_full(gpt_stage(*whole, plan, 1), hidden, false, {});  // middle
  expect_split_equals_full(gpt_stage(*whole, plan, 2), hidden, true, ids);  // the loss
}

TEST(SplitBackward, CheckpointedBlocksDoTheirWeightWorkInTheInputHalf) {
  const nn::GPTConfig config = test::small_gpt_config(/*layers=*/2);
  torch::manual_seed(6);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 2);
  StageModule stage = gpt_stage(*whole, plan, 1);
  for (const auto& block : stage->blocks()) nn::set_activation_checkpointing(*block);
  expect_split_equals_full(stage, at::randn({2, 8, config.n_embd}), true,
                           test::random_tokens({2, 8}, config.vocab_size, 8));
}

TEST(SplitBackward, RefusesAParameterUsedAtTwoDepths) {
  torch::nn::Linear shared(4, 4);
  at::Tensor x = at::randn({2, 4}).requires_grad_(true);
  at::Tensor y = shared(torch::relu(shared(x)));
  SplitBackward backward(y, x, shared->parameters());
  EXPECT_THAT([&] { backward.backward_input(at::ones_like(y)); },
              testing::ThrowsMessage<ArgumentError>(testing::HasSubstr("used at two places")));
}

}  // namespace
}  // namespace hp::pp
