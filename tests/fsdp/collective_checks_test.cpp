// fully_shard under cross-rank collective checks (HP_CHECK_COLLECTIVES,
// collective_checks.h): ranks whose models disagree in one block's shape
// get a CollectiveError naming both calls at that block's first all-gather,
// instead of Gloo aborting the processes. CMakeLists.txt also runs training
// tests with the checks on, where every call must agree.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>

#include "hp/distributed/collective_checks.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/util/error.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/toy_model.h"

namespace hp {
namespace {

using testing::AllOf;
using testing::HasSubstr;
using testing::ThrowsMessage;

// Turns the checks on for its lifetime, then back to what they were (the
// CTest entry that sets HP_CHECK_COLLECTIVES=1 keeps them on after).
struct ChecksOn {
  ChecksOn() : before(dist::collective_checks_enabled()) { dist::set_collective_checks(true); }
  ~ChecksOn() { dist::set_collective_checks(before); }
  bool before;
};

TEST(CollectiveChecks, RanksWithDifferentModelsFailAtTheFirstDifferingGather) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "needs two ranks to disagree";
  ChecksOn checks;
  // Rank 0's blocks have a hidden size of 14, the others' 20: the root's own
  // parameters (embed, head) agree, block 0's fc1.weight [hidden, 10] does
  // not, and neither do its padded shards on 2, 3 or 4 ranks.
  const int64_t world = dist::get_world_size();
  torch::manual_seed(1234);
  test::ToyModel model(6, 10, dist::get_rank() == 0 ? 14 : 20, 5, 2);
  auto shard_numel = [&](int64_t hidden) { return (hidden + world - 1) / world * 10; };
  for (auto& block : model->block_list) fully_shard(block.ptr());
  fully_shard(model.ptr());
  auto [x, y] = test::global_batch(0);
  EXPECT_THAT([&] { model(test::rows_for(x, dist::get_rank(), world)); },
              ThrowsMessage<CollectiveError>(
                  AllOf(HasSubstr("collective mismatch on group"),
                        HasSubstr("group rank 0 (global 0): all_gather"),
                        HasSubstr("input numel " + std::to_string(shard_numel(14)) + ","),
                        HasSubstr("input numel " + std::to_string(shard_numel(20)) + ","))));
}

// The CTest entries that set HP_CHECK_COLLECTIVES=1 rely on it reaching the
// checks: otherwise they would run unchecked and pass all the same.
TEST(CollectiveChecks, EnvironmentVariableTurnsThemOn) {
  const char* value = std::getenv("HP_CHECK_COLLECTIVES");
  if (value == nullptr || std::string(value) != "1") GTEST_SKIP() << "HP_CHECK_COLLECTIVES unset";
  EXPECT_TRUE(dist::collective_checks_enabled());
}

}  // namespace
}  // namespace hp
