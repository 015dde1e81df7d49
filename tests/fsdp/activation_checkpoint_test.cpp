// Activation checkpointing (N4) under fully_shard: a GPT whose blocks are
// units and checkpointed trains exactly as the same GPT without
// checkpointing on the same mesh (losses and every gradient shard bitwise
// equal over several AdamW steps: the same kernels on the same values, the
// same collectives in the same order), with prefetch, reshard_after_forward
// and comm_fusion variants, dropout and bf16 mixed precision; the unit's
// pre-backward gather serves the recomputation (no extra all-gather); peak
// memory goes down; units nested inside a checkpointed block gather once
// for the recomputation and their backward; an error inside the
// recomputation leaves the tree as if the step had not happened. CTest runs
// it on 2, 3 and 4 ranks.
#include "hp/nn/activation_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>
#include <vector>

#include "hp/distributed/comm_stats.h"
#include "hp/util/memory_stats.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/model_configs.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

struct Case {
  std::string name;
  test::MeshConfig mesh;
  bool fusion = false;
  bool prefetch = true;
  int64_t reshard = -1;  // -1: true, 0: false, N: groups of N ranks
  double dropout = 0.0;
  bool bf16 = false;
};

nn::GPT make_model(const Case& c, bool checkpointed) {
  torch::manual_seed(7);
  nn::GPTConfig config = test::small_gpt_config(2);
  config.dropout = c.dropout;
  nn::GPT model(config);
  if (checkpointed) {
    for (const nn::Block& block : model->blocks()) nn::set_activation_checkpointing(*block.ptr());
  }
  return model;
}

FSDPModule shard(nn::GPT& model, const Case& c) {
  FullyShardOptions options;
  options.mesh = test::make_mesh(c.mesh);
  options.comm_fusion = c.fusion;
  if (c.reshard == 0) options.reshard_after_forward = false;
  if (c.reshard > 0) options.reshard_after_forward = c.reshard;
  if (c.bf16) {
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.output_dtype = at::kFloat;
  }
  FSDPModule root = test::shard_gpt(model, options);
  root.set_implicit_prefetch(c.prefetch);
  return root;
}

// One forward and backward of this rank's rows of step `step`'s batch;
// dropout draws from a generator seeded alike for both runs.
at::Tensor forward_backward(nn::GPT& model, int step) {
  torch::manual_seed(100 * step + dist::get_rank());
  at::Tensor loss = test::gpt_loss(model, test::token_batch(step, test::kBatch),
                                   test::my_first_row(), test::my_rows(), at::kFloat);
  loss.backward();
  return loss.detach();
}

// Local loss and gradient shards equal bit for bit, step after step.
void expect_same_training(const Case& c) {
  nn::GPT plain = make_model(c, false);
  nn::GPT ckpt = make_model(c, true);
  FSDPModule plain_root = shard(plain, c);
  FSDPModule ckpt_root = shard(ckpt, c);
  auto plain_opt = test::make_adamw(*plain);
  auto ckpt_opt = test::make_adamw(*ckpt);
  auto plain_params = plain->named_parameters();
  auto ckpt_params = ckpt->named_parameters();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor plain_loss = forward_backward(plain, step);
    at::Tensor ckpt_loss = forward_backward(ckpt, step);
    EXPECT_TRUE(torch::equal(plain_loss, ckpt_loss))
        << plain_loss.item<double>() << " vs " << ckpt_loss.item<double>();
    for (const auto& p : plain_params) {
      const at::Tensor& mine = ckpt_params[p.key()].grad();
      ASSERT_EQ(mine.defined(), p.value().grad().defined()) << p.key();
      if (mine.defined()) {
        EXPECT_TRUE(torch::equal(p.value().grad(), mine)) << p.key();
      }
    }
    plain_opt.step();
    ckpt_opt.step();
    plain_opt.zero_grad();
    ckpt_opt.zero_grad();
  }
  for (const auto& p : plain_params) {
    EXPECT_TRUE(torch::equal(p.value(), ckpt_params[p.key()])) << p.key() << " after training";
  }
}

// Each mode, and each setting that changes when parameters are gathered
// and resharded; dropout where the generator replay matters.
std::vector<Case> cases() {
  const int64_t w = dist::get_world_size();
  const test::MeshConfig fsdp{"fsdp", {w}};
  std::vector<Case> out = {
      {"fsdp dropout", fsdp, false, true, -1, /*dropout=*/0.2},
      {"fsdp fused dropout", fsdp, true, true, -1, /*dropout=*/0.2},
      {"ddp", {"ddp", {w, 1}}},
      {"fsdp no prefetch", fsdp, false, /*prefetch=*/false},
      {"fsdp fused reshard_after_forward false", fsdp, true, true, /*reshard=*/0},
  };
  if (w == 4) {
    out.push_back({"hsdp fused", {"hsdp", {2, 2}}, true});
    out.push_back({"fsdp reshard_after_forward 2", fsdp, false, true, /*reshard=*/2});
  }
  return out;
}

TEST(ActivationCheckpointFSDP, TrainsBitwiseLikeWithout) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    expect_same_training(c);
  }
}

TEST(ActivationCheckpointFSDP, Bf16TrainsBitwiseLikeWithout) {
  const test::MeshConfig fsdp{"fsdp", {dist::get_world_size()}};
  for (bool fusion : {false, true}) {
    SCOPED_TRACE(fusion ? "fused" : "unfused");
    Case c{"bf16", fsdp, fusion};
    c.bf16 = true;
    c.dropout = 0.2;
    expect_same_training(c);
  }
}

// Units nested inside a checkpointed block (its attention and MLP are the
// units, not the block): the recomputation calls them through their hooks,
// so they gather for it, and keep their parameters for the backward that
// follows at once: no more all-gathers than without checkpointing, and
// training is still exact.
TEST(ActivationCheckpointFSDP, NestedUnitsTrainBitwiseLikeWithout) {
  const Case c{"nested", {"fsdp", {dist::get_world_size()}}};
  auto shard_nested = [&](nn::GPT& model) {
    FullyShardOptions options;
    options.mesh = test::make_mesh(c.mesh);
    for (const nn::Block& block : model->blocks()) {
      fully_shard(block->attn.ptr(), options);
      fully_shard(block->mlp.ptr(), options);
    }
    return fully_shard(model.ptr(), options);
  };
  nn::GPT plain = make_model(c, false);
  nn::GPT ckpt = make_model(c, true);
  FSDPModule plain_root = shard_nested(plain);
  FSDPModule ckpt_root = shard_nested(ckpt);
  auto plain_params = plain->named_parameters();
  auto ckpt_params = ckpt->named_parameters();
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    plain_root.zero_grad();
    ckpt_root.zero_grad();
    dist::reset_comm_stats();
    at::Tensor plain_loss = forward_backward(plain, step);
    const int64_t plain_gathers = dist::comm_stats()[dist::OpType::kAllGather];
    dist::reset_comm_stats();
    at::Tensor ckpt_loss = forward_backward(ckpt, step);
    EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllGather], plain_gathers);
    EXPECT_TRUE(torch::equal(plain_loss, ckpt_loss));
    for (const auto& p : plain_params) {
      EXPECT_TRUE(torch::equal(p.value().grad(), ckpt_params[p.key()].grad())) << p.key();
    }
  }
}

// The all-gathers, reduce-scatters and all-reduces of one steady-state step.
dist::CommStats step_collectives(nn::GPT& model, int step) {
  dist::reset_comm_stats();
  forward_backward(model, step);
  return dist::comm_stats();
}

TEST(ActivationCheckpointFSDP, RecomputationGathersNothingMore) {
  const test::MeshConfig fsdp{"fsdp", {dist::get_world_size()}};
  for (const Case& c : {Case{"unfused", fsdp}, Case{"fused", fsdp, true},
                        Case{"no prefetch", fsdp, false, false}}) {
    SCOPED_TRACE(c.name);
    nn::GPT plain = make_model(c, false);
    nn::GPT ckpt = make_model(c, true);
    FSDPModule plain_root = shard(plain, c);
    FSDPModule ckpt_root = shard(ckpt, c);
    // The first step records the forward order that prefetch follows.
    forward_backward(plain, 0);
    forward_backward(ckpt, 0);
    const dist::CommStats without = step_collectives(plain, 1);
    const dist::CommStats with = step_collectives(ckpt, 1);
    // Every block is gathered for its forward and again in its pre-backward
    // (reshard_after_forward), which also serves the recomputation.
    EXPECT_GT(without[dist::OpType::kAllGather], 0);
    EXPECT_EQ(with.calls, without.calls)
        << "with " << with.describe_calls() << "; without " << without.describe_calls();
  }
}

// A GPT whose activations outweigh its parameters: 4 blocks of width 64
// over 48 tokens x 8 sequences per rank.
nn::GPT make_wide_batch_model(bool checkpointed) {
  torch::manual_seed(9);
  nn::GPT model(test::gpt_config(
      {/*vocab=*/64, /*context=*/48, /*layers=*/4, /*heads=*/4, /*width=*/64}));
  if (checkpointed) {
    for (const nn::Block& block : model->blocks()) nn::set_activation_checkpointing(*block.ptr());
  }
  return model;
}

struct StepMemory {
  int64_t after_forward;  // bytes the forward left alive (what backward will use)
  int64_t peak;           // peak of the whole forward and backward
};

StepMemory measure(nn::GPT& model, const at::Tensor& tokens) {
  at::Tensor inputs = tokens.narrow(1, 0, 48), targets = tokens.narrow(1, 1, 48);
  reset_peak_memory();
  const int64_t before = memory_stats().current_bytes;
  at::Tensor loss = nn::cross_entropy(model(inputs), targets);
  const int64_t after_forward = memory_stats().current_bytes - before;
  loss.backward();
  return {after_forward, memory_stats().peak_bytes - before};
}

TEST(ActivationCheckpointFSDP, KeepsOnlyBlockInputsAndLowersThePeak) {
  enable_memory_tracking();
  const Case c{"fsdp", {"fsdp", {dist::get_world_size()}}};
  at::Generator gen = at::detail::createCPUGenerator(77 + dist::get_rank());
  at::Tensor tokens = at::randint(0, 64, {8, 49}, gen, at::kLong);

  // What one block's forward keeps for its backward, beyond its output
  // (which the next block or the final norm keeps in both runs).
  int64_t block_saved = 0;
  {
    nn::GPT probe = make_wide_batch_model(false);
    nn::Block block = probe->blocks()[0];
    at::Tensor x = torch::randn({8, 48, 64}, torch::requires_grad());
    const int64_t before = memory_stats().current_bytes;
    at::Tensor y = block(x);
    block_saved = memory_stats().current_bytes - before - static_cast<int64_t>(y.nbytes());
  }

  StepMemory plain_memory{}, ckpt_memory{};
  {
    nn::GPT plain = make_wide_batch_model(false);
    FSDPModule root = shard(plain, c);
    measure(plain, tokens);  // the first step allocates gradients and records the order
    plain->zero_grad();
    plain_memory = measure(plain, tokens);
  }
  {
    nn::GPT ckpt = make_wide_batch_model(true);
    FSDPModule root = shard(ckpt, c);
    measure(ckpt, tokens);
    ckpt->zero_grad();
    ckpt_memory = measure(ckpt, tokens);
  }
  std::printf(
      "[rank %d] block keeps %lld bytes; after forward: %lld without checkpointing, %lld "
      "with; peak %lld without, %lld with\n",
      dist::get_rank(), static_cast<long long>(block_saved),
      static_cast<long long>(plain_memory.after_forward),
      static_cast<long long>(ckpt_memory.after_forward), static_cast<long long>(plain_memory.peak),
      static_cast<long long>(ckpt_memory.peak));
  // A checkpointed block keeps its input (alive anyway as the previous
  // block's output) and its generator state (the CPU generator's 5056
  // bytes), instead of what the probe measured. The counters are
  // process-wide: a collective of the previous step completing on Gloo's
  // threads may free its buffers inside the measured window, at most one
  // unit's unsharded parameters or gradients (a block's parameter bytes).
  const int64_t rng_state_bytes = 5056;
  int64_t block_param_bytes = 0;
  {
    nn::GPT probe = make_wide_batch_model(false);
    for (const auto& p : probe->blocks()[0]->parameters()) block_param_bytes += p.nbytes();
  }
  EXPECT_GE(plain_memory.after_forward - ckpt_memory.after_forward,
            4 * (block_saved - rng_state_bytes) - block_param_bytes);
  EXPECT_LT(ckpt_memory.peak, plain_memory.peak);
}

TEST(ActivationCheckpointFSDP, ErrorInTheRecomputationLeavesTheTreeAsBefore) {
  const Case c{"fsdp", {"fsdp", {dist::get_world_size()}}};
  nn::GPT plain = make_model(c, false);
  nn::GPT ckpt = make_model(c, true);
  FSDPModule plain_root = shard(plain, c);
  FSDPModule ckpt_root = shard(ckpt, c);
  bool fail = false;
  nn::Block failing = ckpt->blocks()[1];
  failing->mlp->register_forward_pre_hook(
      [&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
        if (fail) throw std::runtime_error("mlp fails in the recomputation");
        return std::nullopt;
      });
  auto plain_params = plain->named_parameters();
  auto ckpt_params = ckpt->named_parameters();
  {
    torch::manual_seed(5);
    at::Tensor loss = test::gpt_loss(ckpt, test::token_batch(0, test::kBatch), test::my_first_row(),
                                     test::my_rows());
    fail = true;  // every rank fails at the same point
    EXPECT_THAT([&] { loss.backward(); },
                ThrowsMessage<std::runtime_error>(HasSubstr("mlp fails in the recomputation")));
    fail = false;
  }
  // Every parameter holds its shard again and no gradient of the failed
  // backward is left.
  for (const auto& p : plain_params) {
    EXPECT_EQ(ckpt_params[p.key()].sizes(), p.value().sizes()) << p.key();
    const at::Tensor& g = ckpt_params[p.key()].grad();
    EXPECT_TRUE(!g.defined() || g.eq(0).all().item<bool>()) << p.key();
  }
  // The next steps train as if the failed one had not happened.
  auto plain_opt = test::make_adamw(*plain);
  auto ckpt_opt = test::make_adamw(*ckpt);
  for (int step = 0; step < 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    ckpt_opt.zero_grad();
    plain_opt.zero_grad();
    at::Tensor plain_loss = forward_backward(plain, step);
    at::Tensor ckpt_loss = forward_backward(ckpt, step);
    EXPECT_TRUE(torch::equal(plain_loss, ckpt_loss));
    for (const auto& p : plain_params) {
      EXPECT_TRUE(torch::equal(p.value().grad(), ckpt_params[p.key()].grad())) << p.key();
    }
    plain_opt.step();
    ckpt_opt.step();
  }
}

}  // namespace
}  // namespace hp
