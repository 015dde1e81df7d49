// Stage plans and stage modules (docs/pipeline.md), in one process.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

#include "hp/fsdp/materialize.h"
#include "hp/nn/gpt.h"
#include "hp/nn/llama.h"
#include "hp/pp/stage_module.h"
#include "hp/pp/stage_plan.h"
#include "hp/util/error.h"
#include "tests/support/model_configs.h"
#include "tests/support/random_tokens.h"
#include "tests/support/tensor_checks.h"

namespace hp::pp {
namespace {

using testing::HasSubstr;
using testing::ThrowsMessage;

std::vector<size_t> blocks_per_stage(const StagePlan& plan, const std::string& prefix) {
  std::vector<size_t> counts;
  for (const auto& stage : plan.stages) {
    size_t n = 0;
    for (const auto& m : stage) n += m.rfind(prefix, 0) == 0;
    counts.push_back(n);
  }
  return counts;
}

TEST(StagePlan, BalancesBlocksCountingTheEmbeddingsAndTheHeadAsOneBlockEach) {
  const ModelLayout layout = gpt_layout(test::small_gpt_config(/*layers=*/8));
  // 8 blocks + 2 over 4 stages: loads 3, 3, 2, 2 (torchtitan's split).
  StagePlan plan = plan_stages(layout, 4);
  EXPECT_EQ(blocks_per_stage(plan, "h."), (std::vector<size_t>{2, 3, 2, 1}));
  EXPECT_EQ(plan.stages[0], (std::vector<std::string>{"wte", "wpe", "h.0", "h.1"}));
  EXPECT_EQ(plan.stages[3], (std::vector<std::string>{"h.7", "ln_f", "lm_head"}));
  EXPECT_EQ(blocks_per_stage(plan_stages(layout, 1), "h."), (std::vector<size_t>{8}));
  EXPECT_EQ(blocks_per_stage(plan_stages(layout, 8), "h."), std::vector<size_t>(8, 1));
  EXPECT_EQ(blocks_per_stage(plan_stages(layout, 3), "h."), (std::vector<size_t>{3, 3, 2}));
  EXPECT_EQ(plan.stage_of("h.3.attn.c_attn.weight"), 1);
  EXPECT_EQ(plan.stage_of("lm_head.weight"), 3);
  EXPECT_EQ(plan.stage_of("h.30.attn.c_attn.weight"), -1);
  EXPECT_NO_THROW(check_stage_plan(layout, plan));
}

TEST(StagePlan, SplitPointsGiveUnevenStages) {
  const ModelLayout layout = llama_layout(test::tiny_llama_config());  // 2 layers
  StagePlan plan = plan_stages(layout, 2, {"model.layers.1"});
  EXPECT_EQ(plan.stages[0], (std::vector<std::string>{"model.embed_tokens", "model.layers.0"}));
  EXPECT_EQ(plan.stages[1], (std::vector<std::string>{"model.layers.1", "model.norm", "lm_head"}));
  const ModelLayout gpt = gpt_layout(test::small_gpt_config(/*layers=*/6));
  EXPECT_EQ(blocks_per_stage(plan_stages(gpt, 3, {"h.1", "h.5"}), "h."),
            (std::vector<size_t>{1, 4, 1}));
}

TEST(StagePlan, RefusesPlansThatCannotWork) {
  const ModelLayout layout = gpt_layout(test::small_gpt_config(/*layers=*/4));
  EXPECT_THAT([&] { plan_stages(layout, 5); },
              ThrowsMessage<ArgumentError>(HasSubstr("num_stages 5 exceeds the model's 4 blocks")));
  EXPECT_THAT([&] { plan_stages(layout, 0); },
              ThrowsMessage<ArgumentError>(HasSubstr("num_stages 0 must be at least 1")));
  EXPECT_THAT([&] { plan_stages(layout, 2, {"h.9"}); },
              ThrowsMessage<ArgumentError>(HasSubstr("split point 'h.9' names no block")));
  EXPECT_THAT([&] { plan_stages(layout, 2, {"blocks.2"}); },
              ThrowsMessage<ArgumentError>(HasSubstr("its blocks are h.0 .. h.3")));
  EXPECT_THAT([&] { plan_stages(layout, 2, {"h.0"}); },
              ThrowsMessage<ArgumentError>(HasSubstr("stage 0 would hold no block")));
  EXPECT_THAT(
      [&] {
        plan_stages(layout, 3, {"h.2", "h.1"});
      },
      ThrowsMessage<ArgumentError>(HasSubstr("is not after the previous one")));
  EXPECT_THAT([&] { plan_stages(layout, 3, {"h.2"}); },
              ThrowsMessage<ArgumentError>(HasSubstr("1 split points ['h.2'] for num_stages 3")));
  StagePlan hand;
  hand.stages = {{"wte", "wpe", "h.0", "h.1"}, {"h.3", "h.2", "ln_f", "lm_head"}};
  EXPECT_THAT([&] { check_stage_plan(layout, hand); },
              ThrowsMessage<ArgumentError>(HasSubstr("module 'h.3' out of place")));
  hand.stages = {{"wte", "wpe", "h.0", "h.1", "h.2", "h.3"}, {"ln_f", "lm_head"}};
  EXPECT_THAT(
      [&] { check_stage_plan(layout, hand); },
      ThrowsMessage<ArgumentError>(HasSubstr("stage 1 ['ln_f', 'lm_head'] holds no block")));
  hand.stages = {{"wte", "wpe", "h.0", "h.1"}, {"h.2", "h.3", "ln_f"}};
  EXPECT_THAT([&] { check_stage_plan(layout, hand); },
              ThrowsMessage<ArgumentError>(HasSubstr("module 'lm_head' is in no stage")));
}

std::set<std::string> names_of(const torch::nn::Module& m) {
  std::set<std::string> names;
  for (const auto& item : m.named_parameters()) names.insert(item.key());
  return names;
}

TEST(StageModule, StagesHoldTheWholeModelsParametersUnderItsNamesOnceEach) {
  const nn::GPTConfig config = test::small_gpt_config(/*layers=*/5);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 3);
  std::set<std::string> seen;
  for (int s = 0; s < 3; ++s) {
    StageModule stage = gpt_stage(*whole, plan, s);
    for (const auto& item : stage->named_parameters()) {
      EXPECT_TRUE(seen.insert(item.key()).second) << item.key();
      // The same tensor, not a copy.
      EXPECT_TRUE(item.value().is_same(whole->named_parameters()[item.key()])) << item.key();
    }
    EXPECT_EQ(stage->blocks().size(), blocks_per_stage(plan, "h.")[s]);
  }
  EXPECT_EQ(seen, names_of(*whole));
}

// Chained stage forwards compute the whole model's forward, bit for bit
// (the same ops on the same values in the same order).
TEST(StageModule, ChainedStagesComputeTheWholeModelsLogits) {
  const nn::GPTConfig config = test::small_gpt_config(/*layers=*/4);
  torch::manual_seed(3);
  nn::GPT whole(config);
  const at::Tensor ids = test::random_tokens({2, 8}, config.vocab_size, 5);
  const at::Tensor expected = whole->forward(ids);
  const StagePlan plan = plan_stages(gpt_layout(config), 3, {"h.1", "h.2"});
  at::Tensor x = ids;
  for (int s = 0; s < 3; ++s) x = gpt_stage(*whole, plan, s)(x);
  EXPECT_TRUE(test::tensors_equal(x, expected));

  const nn::LlamaConfig lconfig = test::tiny_llama_config();
  nn::Llama llama(lconfig);
  const at::Tensor lexpected = llama->forward(ids);
  const StagePlan lplan = plan_stages(llama_layout(lconfig), 2);
  x = ids;
  for (int s = 0; s < 2; ++s) x = llama_stage(*llama, lplan, s)(x);
  EXPECT_TRUE(test::tensors_equal(x, lexpected));
}

TEST(StageModule, RefusesInputsOfTheWrongKind) {
  const nn::GPTConfig config = test::small_gpt_config(/*layers=*/2);
  nn::GPT whole(config);
  const StagePlan plan = plan_stages(gpt_layout(config), 2);
  StageModule first = gpt_stage(*whole, plan, 0), second = gpt_stage(*whole, plan, 1);
  EXPECT_THAT(
      [&] {
        first(at::zeros({2, 4, 64}));
      },
      ThrowsMessage<ArgumentError>(HasSubstr("stage 0 takes int64 token ids [B, T]")));
  EXPECT_THAT(
      [&] {
        second(at::zeros({2, 4}, at::kLong));
      },
      ThrowsMessage<ArgumentError>(HasSubstr("stage 1 takes hidden states [B, T, 64]")));
  EXPECT_THAT([&] { gpt_stage(*whole, plan, 2); },
              ThrowsMessage<ArgumentError>(HasSubstr("stage 2 out of range for a plan of 2")));
}

// Each stage cut from a meta model and initialised alone gets the eager
// whole model's values bit for bit: the other stages' draws are made and
// dropped in their places (GPT-2 redraws its c_proj weights after the
// first pass, so a stage's steps are not contiguous in the plan).
TEST(StageModule, MetaStagesInitialisedAloneGetTheEagerModelsValues) {
  const nn::GPTConfig config = test::small_gpt_config(/*layers=*/4);
  torch::manual_seed(11);
  nn::GPT eager(config);
  const at::Tensor after_eager = at::randn({4});  // the generator's state after init
  const StagePlan plan = plan_stages(gpt_layout(config), 3);
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(11);
    nn::GPT whole(config, at::kMeta);
    StageModule stage = gpt_stage(*whole, plan, s);
    const nn::InitPlan init = stage_init_plan(*whole, whole->init_plan(), *stage);
    whole = nullptr;
    init_sharded(*stage, init);
    for (const auto& item : stage->named_parameters())
      EXPECT_TRUE(test::tensors_equal(item.value(), eager->named_parameters()[item.key()]))
          << "stage " << s << " " << item.key();
    EXPECT_TRUE(test::tensors_equal(at::randn({4}), after_eager)) << "stage " << s;
  }
  const nn::LlamaConfig lconfig = test::tiny_llama_config();
  torch::manual_seed(12);
  nn::Llama leager(lconfig);
  const StagePlan lplan = plan_stages(llama_layout(lconfig), 2);
  for (int s = 0; s < 2; ++s) {
    torch::manual_seed(12);
    nn::Llama whole(lconfig, at::kMeta);
    StageModule stage = llama_stage(*whole, lplan, s);
    init_sharded(*stage, stage_init_plan(*whole, whole->init_plan(), *stage));
    for (const auto& item : stage->named_parameters())
      EXPECT_TRUE(test::tensors_equal(item.value(), leager->named_parameters()[item.key()]))
          << "stage " << s << " " << item.key();
  }
}

}  // namespace
}  // namespace hp::pp
