// Activation checkpointing (N4) of a tensor-parallel GPT (S4): the blocks'
// inputs are tensor-form DTensors, saved and recomputed through the same
// autograd function, their collectives issued again in the recomputation.
// Losses and every gradient shard equal the same model without
// checkpointing bit for bit (same mesh, same collectives in the same
// order), with dropout off and on, over AdamW steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/gpt_plan.h"
#include "hp/tp/shard_module.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

nn::GPT tp_model(double dropout, bool checkpointed, const DeviceMeshPtr& mesh) {
  nn::GPTConfig config = test::tp_small_config();
  config.dropout = dropout;
  torch::manual_seed(1234);
  nn::GPT model(config);
  if (checkpointed) {
    for (const nn::Block& block : model->blocks()) nn::set_activation_checkpointing(*block.ptr());
  }
  shard_module(model, mesh, gpt_tensor_parallel_plan(config, *mesh));
  return model;
}

at::Tensor local(const at::Tensor& t) { return is_dtensor(t) ? local_of(t) : t; }

class ActivationCheckpointTP : public ::testing::TestWithParam<double> {};

TEST_P(ActivationCheckpointTP, TrainsBitwiseLikeWithout) {
  auto mesh = test::tp_mesh();
  nn::GPT plain = tp_model(GetParam(), false, mesh);
  nn::GPT ckpt = tp_model(GetParam(), true, mesh);
  torch::optim::AdamW plain_opt(plain->parameters(), torch::optim::AdamWOptions(1e-3));
  torch::optim::AdamW ckpt_opt(ckpt->parameters(), torch::optim::AdamWOptions(1e-3));
  auto plain_params = plain->named_parameters();
  auto ckpt_params = ckpt->named_parameters();
  auto gen = at::detail::createCPUGenerator(99);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor idx = torch::randint(50, {3, 8}, gen, torch::kLong);
    at::Tensor targets = torch::randint(50, {3, 8}, gen, torch::kLong);
    auto run = [&](nn::GPT& model, torch::optim::AdamW& opt) {
      opt.zero_grad();
      torch::manual_seed(40 + step);  // dropout: the same draws on every rank and in both runs
      at::Tensor loss = nn::cross_entropy(model(idx), targets);
      loss.backward();
      return test::whole(loss.detach());
    };
    at::Tensor plain_loss = run(plain, plain_opt);
    at::Tensor ckpt_loss = run(ckpt, ckpt_opt);
    EXPECT_TRUE(torch::equal(plain_loss, ckpt_loss))
        << plain_loss.item<double>() << " vs " << ckpt_loss.item<double>();
    for (const auto& p : plain_params) {
      const at::Tensor& want = p.value().grad();
      const at::Tensor& got = ckpt_params[p.key()].grad();
      ASSERT_TRUE(got.defined()) << p.key();
      if (is_dtensor(want)) {
        EXPECT_EQ(layout_of(got), layout_of(want)) << p.key();
      }
      EXPECT_TRUE(torch::equal(local(want), local(got))) << p.key();
    }
    plain_opt.step();
    ckpt_opt.step();
  }
}

INSTANTIATE_TEST_SUITE_P(Dropout, ActivationCheckpointTP, ::testing::Values(0.0, 0.2),
                         [](const auto& info) { return info.param > 0 ? "On" : "Off"; });

}  // namespace
}  // namespace hp
