// hp::plan::ParallelLayout (hp/plan/parallel_layout.h): the sizes and rank
// coordinates every mode's mesh gives, and the one parser of each setting.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hp/plan/parallel_layout.h"
#include "hp/util/error.h"

namespace hp::plan {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

struct Sizes {
  int64_t tp, shard, replicate, dp, world;
};

Sizes sizes_of(const ParallelLayout& l) {
  return {l.tp_size(), l.shard_size(), l.replicate_size(), l.dp_size(), l.world_size()};
}

void expect_sizes(const ParallelLayout& l, Sizes want) {
  const Sizes got = sizes_of(l);
  EXPECT_EQ(got.tp, want.tp) << l.describe();
  EXPECT_EQ(got.shard, want.shard) << l.describe();
  EXPECT_EQ(got.replicate, want.replicate) << l.describe();
  EXPECT_EQ(got.dp, want.dp) << l.describe();
  EXPECT_EQ(got.world, want.world) << l.describe();
}

TEST(ParallelLayout, EveryModesSizesComeFromItsMeshDims) {
  expect_sizes(ParallelLayout(), {1, 1, 1, 1, 1});
  expect_sizes(ParallelLayout(ParallelMode::kFSDP, {3}), {1, 3, 1, 3, 3});
  expect_sizes(ParallelLayout(ParallelMode::kHSDP, {2, 3}), {1, 3, 2, 6, 6});
  expect_sizes(ParallelLayout(ParallelMode::kDDP, {4, 1}), {1, 1, 4, 4, 4});
  expect_sizes(ParallelLayout(ParallelMode::kTP, {4}), {4, 1, 1, 1, 4});
  expect_sizes(ParallelLayout(ParallelMode::kFSDPTP, {3, 2}), {2, 3, 1, 3, 6});
  EXPECT_EQ(ParallelLayout(ParallelMode::kHSDP, {2, 3}).mesh_names,
            (std::vector<std::string>{"replicate", "shard"}));
}

TEST(ParallelLayout, RanksAreRowMajorWithTensorParallelInnermost) {
  const ParallelLayout fsdp_tp(ParallelMode::kFSDPTP, {3, 2});
  EXPECT_EQ(fsdp_tp.dp_rank(5), 2);
  EXPECT_EQ(fsdp_tp.shard_rank(5), 2);
  EXPECT_EQ(fsdp_tp.tp_rank(5), 1);
  const ParallelLayout hsdp(ParallelMode::kHSDP, {2, 3});
  EXPECT_EQ(hsdp.dp_rank(4), 4);
  EXPECT_EQ(hsdp.shard_rank(4), 1);
  EXPECT_EQ(ParallelLayout(ParallelMode::kTP, {4}).dp_rank(3), 0);
}

TEST(ParallelLayout, FullyShardAndTensorParallelism) {
  EXPECT_FALSE(ParallelLayout().uses_fully_shard());
  ParallelLayout tp(ParallelMode::kTP, {2});
  EXPECT_TRUE(tp.tensor_parallel());
  EXPECT_FALSE(tp.uses_fully_shard());
  tp.tp_units = true;  // --mode tp given fully_shard's flags
  EXPECT_TRUE(tp.uses_fully_shard());
  EXPECT_FALSE(ParallelLayout(ParallelMode::kDDP, {2, 1}).tensor_parallel());
}

TEST(ParallelLayout, AMeshThatDoesNotFitTheModeNamesBoth) {
  EXPECT_THAT([] { ParallelLayout(ParallelMode::kFSDPTP, {4}); },
              ThrowsMessage<ArgumentError>(HasSubstr("mode fsdp_tp takes a 2-D mesh but got [4]")));
  EXPECT_THAT([] { ParallelLayout(ParallelMode::kDDP, {2, 2}); },
              ThrowsMessage<ArgumentError>(HasSubstr("mode ddp takes a mesh [N, 1]")));
  EXPECT_THAT([] { ParallelLayout(ParallelMode::kFSDP, {0}); },
              ThrowsMessage<ArgumentError>(HasSubstr("mesh [0] has a size below 1")));
}

TEST(ParallelLayout, OneParserPerSetting) {
  for (const std::string& name : mode_names()) {
    EXPECT_EQ(mode_name(parse_mode(name, "--mode")), name);
  }
  EXPECT_THAT([] { parse_mode("zero3", "--mode"); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "--mode must be one of fsdp, hsdp, ddp, tp, fsdp_tp, none, got 'zero3'")));
  EXPECT_EQ(parse_dtype("bf16", "d"), Dtype::kBFloat16);
  EXPECT_EQ(parse_dtype("fp16", "d"), Dtype::kFloat16);
  EXPECT_EQ(parse_dtype("fp32", "d"), Dtype::kFloat32);
  EXPECT_EQ(scalar_type(Dtype::kBFloat16), c10::kBFloat16);
  EXPECT_THAT([] { parse_dtype("fp8", "--param-dtype"); },
              ThrowsMessage<ArgumentError>(HasSubstr("--param-dtype must be one of")));
  EXPECT_EQ(parse_reshard_after_forward("true", "r"), ReshardAfterForward(true));
  EXPECT_EQ(parse_reshard_after_forward("false", "r"), ReshardAfterForward(false));
  EXPECT_EQ(parse_reshard_after_forward("4", "r"), ReshardAfterForward(int64_t{4}));
  for (const char* bad : {"0", "-2", "4x", "", "yes"}) {
    EXPECT_THAT([&] { parse_reshard_after_forward(bad, "--reshard-after-forward"); },
                ThrowsMessage<ArgumentError>(HasSubstr("must be true, false or a positive")))
        << bad;
  }
  // The ranks a block's parameters stay spread over, and how the report says it.
  EXPECT_EQ(ranks_after_forward(std::nullopt, 4), 4);
  EXPECT_EQ(ranks_after_forward(true, 4), 4);
  EXPECT_EQ(ranks_after_forward(false, 4), 1);
  EXPECT_EQ(ranks_after_forward(int64_t{2}, 4), 2);
  EXPECT_EQ(describe(ReshardAfterForward(int64_t{2})), "to groups of 2");
  EXPECT_EQ(describe(std::nullopt), "true");
}

}  // namespace
}  // namespace hp::plan
