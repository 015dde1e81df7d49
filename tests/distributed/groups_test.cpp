// Sub-groups (D2): made collectively, cached, tagged groups are
// separate process groups, and collectives on a sub-group involve only its
// members.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>

#include "hp/distributed/collectives.h"
#include "hp/distributed/world.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"

namespace hp::dist {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::tensors_equal;

TEST(Groups, WorldGroupCoversEveryRank) {
  GroupPtr world = world_group();
  EXPECT_EQ(world->size(), get_world_size());
  EXPECT_EQ(world->rank(), get_rank());
  EXPECT_EQ(world->name(), "world");
  EXPECT_EQ(new_group([&] {
              std::vector<int> all;
              for (int r = 0; r < get_world_size(); ++r) all.push_back(r);
              return all;
            }()),
            world)
      << "asking for the world's ranks returns the cached world group";
}

TEST(Groups, EvenAndOddSubgroupsReduceSeparately) {
  const int world = get_world_size(), me = get_rank();
  std::vector<int> even, odd;
  for (int r = 0; r < world; ++r) (r % 2 ? odd : even).push_back(r);
  GroupPtr g_even = new_group(even);
  GroupPtr g_odd = new_group(odd);
  EXPECT_EQ(new_group(even), g_even) << "groups are cached by ranks";
  GroupPtr mine = me % 2 ? g_odd : g_even;
  GroupPtr other = me % 2 ? g_even : g_odd;
  EXPECT_TRUE(mine->is_member());
  EXPECT_FALSE(other->is_member());
  EXPECT_EQ(other->rank(), -1);

  at::Tensor t = at::full({4}, float(me));
  all_reduce(*mine, t).wait();
  float expected = 0;
  for (int r : mine->ranks()) expected += r;
  EXPECT_TRUE(tensors_equal(t, at::full({4}, expected)));

  EXPECT_THAT([&] { all_reduce(*other, t); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("not a member of group"),
                                                 HasSubstr(to_string(other->ranks())))));
}

TEST(Groups, ReversedRankOrderDefinesGroupRanks) {
  const int world = get_world_size();
  std::vector<int> reversed;
  for (int r = world - 1; r >= 0; --r) reversed.push_back(r);
  GroupPtr g = new_group(reversed);
  EXPECT_EQ(g->rank(), world - 1 - get_rank());
  at::Tensor out = at::empty({world});
  all_gather_into(*g, out, at::full({1}, float(get_rank()))).wait();
  std::vector<float> expected;
  for (int r : reversed) expected.push_back(float(r));
  EXPECT_TRUE(tensors_equal(out, at::tensor(expected)));
}

TEST(Groups, TaggedGroupsAreIndependentStreams) {
  std::vector<int> all;
  for (int r = 0; r < get_world_size(); ++r) all.push_back(r);
  GroupPtr a = new_group(all, {"stream-a"});
  // A bounded timeout: if the tags shared one stream, the test fails with
  // b's timeout instead of hanging.
  GroupPtr b = new_group(all, {"stream-b", std::chrono::seconds(20)});
  EXPECT_NE(a, b);
  EXPECT_NE(a, world_group());
  EXPECT_EQ(a->name(), "world#stream-a");
  // A collective in flight on one stream does not block one on the other:
  // every rank but 0 issues a's all-reduce and then b's; rank 0 joins a's
  // only after b's completed and everyone has looked at a's. Were a and b
  // one stream, b's would queue behind a's, which waits for rank 0, which
  // waits for b's.
  const int me = get_rank(), n = get_world_size();
  at::Tensor x = at::ones({1 << 16});
  at::Tensor y = at::ones({8});
  Work wx;
  if (me != 0) wx = all_reduce(*a, x);
  Work wy = all_reduce(*b, y);
  wy.wait();
  EXPECT_TRUE(tensors_equal(y, at::full({8}, float(n))));
  if (me != 0 && n > 1) {
    EXPECT_FALSE(wx.is_completed()) << "a's all-reduce cannot finish before rank 0 joins it";
  }
  barrier(*world_group()).wait();
  if (me == 0) wx = all_reduce(*a, x);
  wx.wait();
  EXPECT_TRUE(tensors_equal(x, at::full({1 << 16}, float(n))));
}

// A group of one completes every collective locally, without the backend;
// the results must still be what the collective defines.
TEST(Groups, SingletonGroupNeedsNoPeers) {
  GroupPtr self = nullptr;
  for (int r = 0; r < get_world_size(); ++r) {
    GroupPtr g = new_group({r});
    if (r == get_rank()) self = g;
  }
  ASSERT_TRUE(self && self->is_member());
  Group& g = *self;
  EXPECT_EQ(g.rank(), 0);
  const uint64_t sequence_before = g.sequence_number();
  const at::Tensor input = at::arange(6, at::kFloat).view({2, 3}) + 10 * get_rank();
  const at::Tensor input_before = input.clone();

  at::Tensor t = at::full({3}, 5.0f);
  all_reduce(g, t, ReduceOp::kAvg).wait();
  EXPECT_TRUE(tensors_equal(t, at::full({3}, 5.0f)));

  // All-gather into a flat buffer: the input, flattened.
  at::Tensor gathered = at::full({6}, -1.0f);
  all_gather_into(g, gathered, input).wait();
  EXPECT_TRUE(tensors_equal(gathered, input.reshape({-1})));

  // Reduce-scatter (avg over one rank) of a non-contiguous input: the input.
  at::Tensor scattered = at::full({3, 2}, -1.0f);
  reduce_scatter(g, scattered, input.t(), ReduceOp::kAvg).wait();
  EXPECT_TRUE(tensors_equal(scattered, input.t().contiguous()));

  // All-to-all, equal and explicit splits: every row stays here.
  at::Tensor exchanged = at::full({2, 3}, -1.0f);
  all_to_all(g, exchanged, input).wait();
  EXPECT_TRUE(tensors_equal(exchanged, input));
  at::Tensor exchanged_split = at::full({2, 3}, -1.0f);
  all_to_all(g, exchanged_split, input, {2}, {2}).wait();
  EXPECT_TRUE(tensors_equal(exchanged_split, input));
  // A larger output must be rejected, not filled by broadcasting the input.
  EXPECT_THAT([&] { all_to_all(g, at::empty({4, 3}), input.narrow(0, 0, 1)); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "all_to_all: with equal splits output [4, 3] Float (12 elements) and input "
                  "[1, 3] Float (3 elements) must have the same number of elements")));

  // Coalesced all-gather into outputs that are not the inputs (one strided).
  at::Tensor b = at::arange(5, at::kFloat) - get_rank();
  at::Tensor wide = at::full({2, 6}, -1.0f);
  at::Tensor out_b = at::full({5}, -1.0f);
  all_gather_coalesced(g, {{wide.narrow(1, 3, 3), out_b}}, {input, b}).wait();
  EXPECT_TRUE(tensors_equal(wide.narrow(1, 3, 3), input));
  EXPECT_TRUE(tensors_equal(wide.narrow(1, 0, 3), at::full({2, 3}, -1.0f)))
      << "only the output view is written";
  EXPECT_TRUE(tensors_equal(out_b, b));

  broadcast(g, t, 0).wait();
  barrier(g).wait();
  EXPECT_TRUE(tensors_equal(input, input_before)) << "no collective may write its input";
  EXPECT_EQ(g.sequence_number(), sequence_before + 8) << "8 collectives; the rejected one is not";
}

TEST(Groups, BadRanksAreRejectedBeforeAnyCommunication) {
  const int world = get_world_size();
  EXPECT_THAT([&] { new_group({0, world}); },
              ThrowsMessage<ArgumentError>(
                  AllOf(HasSubstr("rank " + std::to_string(world) + " in ranks"),
                        HasSubstr("out of range for world size"))));
  EXPECT_THAT([&] { new_group({0, 0}); },
              ThrowsMessage<ArgumentError>(HasSubstr("rank 0 appears twice")));
  EXPECT_THAT([&] { new_group({}); },
              ThrowsMessage<ArgumentError>(HasSubstr("ranks must not be empty")));
  EXPECT_THAT([&] { init_process_group(); },
              ThrowsMessage<ArgumentError>(HasSubstr("already initialized")));
}

}  // namespace
}  // namespace hp::dist
