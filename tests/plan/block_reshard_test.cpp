// hp-train's reshard policy per block (ParallelLayout::block_reshard_after_forward):
// the last block keeps its parameters after forward, the others follow the
// layout. Checked on the layout itself and on what parallelize builds: the
// units' settings, which parameters are gathered after forward, and the
// all-gathers a fused step issues.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "hp/distributed/comm_stats.h"
#include "hp/distributed/launch_env.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/storage.h"
#include "hp/nn/loss.h"
#include "hp/plan/parallel_layout.h"
#include "hp/util/error.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/parallelize.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(BlockReshardAfterForward, LastBlockKeepsItsParameters) {
  plan::ParallelLayout layout(plan::ParallelMode::kFSDP, {4});
  for (const ReshardAfterForward& setting :
       {ReshardAfterForward(), ReshardAfterForward(true), ReshardAfterForward(int64_t{2})}) {
    layout.reshard_after_forward = setting;
    EXPECT_EQ(layout.block_reshard_after_forward(0, 3), setting) << plan::describe(setting);
    EXPECT_EQ(layout.block_reshard_after_forward(1, 3), setting) << plan::describe(setting);
    EXPECT_EQ(layout.block_reshard_after_forward(2, 3), ReshardAfterForward(false))
        << plan::describe(setting);
  }
  // One block is the last one.
  layout.reshard_after_forward = true;
  EXPECT_EQ(layout.block_reshard_after_forward(0, 1), ReshardAfterForward(false));
  EXPECT_THAT([&] { layout.block_reshard_after_forward(3, 3); },
              ThrowsMessage<ArgumentError>(HasSubstr("block 3 is not one of 3 blocks")));
  EXPECT_THAT([&] { layout.block_reshard_after_forward(-1, 3); },
              ThrowsMessage<ArgumentError>(HasSubstr("block -1 is not one of 3 blocks")));
}

TEST(BlockReshardAfterForward, ParallelizeAppliesItAndTheStepGathersLess) {
  if (!dist::started_by_launcher()) GTEST_SKIP() << "needs a process group";
  const dist::LaunchEnv env = dist::read_launch_env();
  const int64_t n = env.world_size;
  World world;
  world.launched = true;
  world.rank = env.rank;
  world.size = env.world_size;
  constexpr int64_t kLayers = 3;
  const CommandLine command_line = parse_command_line(
      {"--mode", "fsdp", "--layers", std::to_string(kLayers), "--d", "32", "--heads", "2",
       "--ctx", "16", "--seq", "16", "--batch", std::to_string(2 * n)});
  const TrainOptions& options = command_line.options;
  const Parallelism parallelism = resolve_parallelism(options, world);
  ASSERT_TRUE(options.comm_fusion && options.prefetch);
  torch::manual_seed(options.seed);
  TrainModel model = TrainModel::build(options, 256);
  std::optional<FSDPModule> root = parallelize(model, parallelism, options);
  ASSERT_TRUE(root);
  const auto blocks = model.blocks();
  ASSERT_EQ(static_cast<int64_t>(blocks.size()), kLayers);
  for (int64_t i = 0; i < kLayers; ++i) {
    EXPECT_EQ(FSDPModule(blocks[i]).reshard_after_forward(),
              i + 1 < kLayers ? ReshardAfterForward() : ReshardAfterForward(false))
        << "block " << i;
  }

  const at::Tensor tokens = torch::randint(0, 256, {4096}, torch::kLong);
  auto step = [&](int64_t s) {
    root->zero_grad();
    Batch batch = batch_for_step(tokens, s, options.batch, options.seq, world.rank, n);
    at::Tensor logits = model(batch.inputs);
    // After forward: the last block and the root hold gathered parameters,
    // the other blocks only their shards.
    for (int64_t i = 0; i < kLayers; ++i) {
      for (const auto& p : blocks[i]->parameters()) {
        EXPECT_EQ(fsdp::storage_is_allocated(p), i + 1 == kLayers) << "block " << i;
      }
    }
    nn::cross_entropy(logits, batch.targets).backward();
  };
  step(0);  // the first step records the order prefetch follows
  const dist::CommStats before = dist::comm_stats();
  step(1);
  const dist::CommStats calls = dist::comm_stats() - before;
  // Fused: one all-gather per unit in forward (root + blocks), one again in
  // backward for every block but the last; one reduce-scatter per unit.
  const int64_t units = kLayers + 1;
  EXPECT_EQ(calls[dist::OpType::kAllGather], units + kLayers - 1) << calls.describe_calls();
  EXPECT_EQ(calls[dist::OpType::kReduceScatter], units) << calls.describe_calls();
}

}  // namespace
}  // namespace hp::train
