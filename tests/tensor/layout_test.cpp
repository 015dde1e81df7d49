// Placements, layouts in their three spellings, the chunk arithmetic and
// the redistribute planner (T1, T2, T4, T5 in docs/features.md).
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hp/distributed/world.h"
#include "hp/tensor/layout.h"
#include "hp/tensor/redistribute_plan.h"
#include "hp/util/error.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// A 2-d mesh ("dp", "tp") over the world.
DeviceMeshPtr mesh_2d() {
  const int w = dist::get_world_size();
  return init_device_mesh("cpu", w % 2 == 0 ? std::vector<int64_t>{2, w / 2}
                                            : std::vector<int64_t>{w, 1},
                          {"dp", "tp"});
}

TEST(Placement, SpellingsAndEquality) {
  EXPECT_EQ(Shard(0).str(), "S(0)");
  EXPECT_EQ(Replicate().str(), "R");
  EXPECT_EQ(Partial().str(), "P(sum)");
  EXPECT_EQ(Partial("avg").str(), "P(avg)");
  EXPECT_EQ(Shard(1), Shard(1));
  EXPECT_NE(Shard(1), Shard(0));
  EXPECT_NE(Partial("max"), Partial("min"));
  EXPECT_NE(Replicate(), Partial());
  EXPECT_EQ(to_string(Placements{Shard(0), Replicate()}), "[S(0), R]");
}

TEST(ChunkSpan, MatchesTorchChunk) {
  for (int64_t length = 0; length <= 13; ++length) {
    for (int64_t pieces = 1; pieces <= 5; ++pieces) {
      at::Tensor t = at::arange(length);
      auto chunks = at::chunk(t, pieces, 0);
      int64_t total = 0;
      for (int64_t i = 0; i < pieces; ++i) {
        Span s = chunk_span(length, pieces, i);
        int64_t expected = i < int64_t(chunks.size()) ? chunks[i].numel() : 0;
        EXPECT_EQ(s.size, expected) << length << " / " << pieces << " piece " << i;
        EXPECT_EQ(s.offset, total);
        total += s.size;
      }
      EXPECT_EQ(total, length);
    }
  }
}

TEST(Layout, AliasPlacementsAndTensorMapRoundTrip) {
  auto mesh = mesh_2d();
  Layout a = Layout::from_alias(mesh, {{"dp"}, {"None"}});
  EXPECT_EQ(a.placements(), (Placements{Shard(0), Replicate()}));
  EXPECT_EQ(a.tensor_map(2), (std::vector<std::vector<int64_t>>{{1}, {-1}}));
  EXPECT_EQ(a.alias_placements(2), (AliasPlacements{{"dp"}, {"None"}}));
  EXPECT_EQ(a.repeat_num(), mesh->size(1));

  Layout b = Layout::from_alias(mesh, {{"None"}, {"dp", "tp"}});
  EXPECT_EQ(b.placements(), (Placements{Shard(1), Shard(1)}));
  EXPECT_EQ(b.mesh_dims_of(1), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(b.tensor_map(2), (std::vector<std::vector<int64_t>>{{-1}, {1, 0}}));
  EXPECT_EQ(b.repeat_num(), 1);
  EXPECT_EQ(b, Layout(mesh, {Shard(1), Shard(1)}));

  // ("tp", "dp"): tp outer, dp fastest; a different layout from ("dp", "tp").
  Layout c = Layout::from_alias(mesh, {{"tp", "dp"}, {"None"}});
  EXPECT_EQ(c.mesh_dims_of(0), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(c.tensor_map(2), (std::vector<std::vector<int64_t>>{{0, 1}, {-1}}));
  EXPECT_NE(c, Layout(mesh, {Shard(0), Shard(0)}));
  EXPECT_EQ(Layout::from_tensor_map(mesh, c.tensor_map(2)), c);
  EXPECT_EQ(Layout::from_tensor_map(mesh, {{-1}, {1, 0}}), b);
  EXPECT_EQ(Layout(mesh, {Replicate(), Replicate()}).repeat_num(), mesh->size());
  EXPECT_THAT(c.str(), HasSubstr("order{0: [1, 0]}"));
}

// The layout algebra the sharding rules, DTensor's autograd and the
// checkpoint build on: each operation replaces some placements, keeps the
// rest and a shard order that still applies, and returns the same layout
// (its spec shared) when nothing changes.
TEST(Layout, OperationsReplacePlacements) {
  auto mesh = mesh_2d();
  const Layout partial(mesh, {Partial("avg"), Shard(1)});
  EXPECT_EQ(partial.without_partial().placements(), (Placements{Replicate(), Shard(1)}));
  EXPECT_EQ(Layout::replicated(mesh).placements(), (Placements{Replicate(), Replicate()}));
  const Layout plain(mesh, {Shard(0), Replicate()});
  EXPECT_EQ(&plain.without_partial().spec(), &plain.spec());
  EXPECT_EQ(&plain.unshard_dim(1).spec(), &plain.spec());
  EXPECT_EQ(&plain.without_strided(Layout::StridedAs::kReplicate).spec(), &plain.spec());
  EXPECT_FALSE(plain.has_strided());

  // Tensor dim 0 sharded by both mesh dims, "tp" outermost: unsharding it
  // drops its order with it; unsharding another dim keeps the order.
  const Layout both = Layout::from_alias(mesh, {{"tp", "dp"}, {"None"}});
  ASSERT_EQ(both.mesh_dims_of(0), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(both.unshard_dim(0), Layout::replicated(mesh));
  EXPECT_EQ(both.unshard_dim(1), both);
  EXPECT_EQ(both.without_partial(), both);

  const Layout strided(mesh, {StridedShard(0, 2), Shard(1)});
  EXPECT_TRUE(strided.has_strided());
  EXPECT_EQ(strided.without_strided(Layout::StridedAs::kReplicate).placements(),
            (Placements{Replicate(), Shard(1)}));
  EXPECT_EQ(strided.without_strided(Layout::StridedAs::kPlainShard).placements(),
            (Placements{Shard(0), Shard(1)}));
  EXPECT_EQ(strided.unshard_dim(0).placements(), (Placements{Replicate(), Shard(1)}));
}

// This rank's piece under a layout is the chunk arithmetic at its coordinate.
TEST(Layout, LocalShapeAndOffsetAtThisRank) {
  auto mesh = mesh_2d();
  const Layout layout(mesh, {Shard(0), Shard(1)});
  const std::vector<int64_t> shape = {7, 5};
  EXPECT_EQ(layout.local_shape(shape),
            local_shape(shape, layout.spec(), mesh->shape(), mesh->coordinate()));
  EXPECT_EQ(layout.local_offset(shape),
            local_offset(shape, layout.spec(), mesh->shape(), mesh->coordinate()));
  const Span rows = chunk_span(7, mesh->size(0), mesh->coordinate(0));
  EXPECT_EQ(layout.local_shape(shape)[0], rows.size);
  EXPECT_EQ(layout.local_offset(shape)[0], rows.offset);
}

TEST(LayoutErrors, AliasAndTensorMapErrors) {
  auto mesh = mesh_2d();
  EXPECT_THAT([&] { Layout::from_alias(mesh, {{"pp"}, {"None"}}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("mesh dim name 'pp' is not one of the mesh's dims ['dp', 'tp']")));
  EXPECT_THAT([&] { Layout::from_alias(mesh, {{"dp"}, {"dp"}}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("mesh dim 'dp' shards tensor dim 0 and tensor dim 1")));
  EXPECT_THAT([&] { Layout::from_alias(mesh, {{"dp", "None"}}); },
              ThrowsMessage<ArgumentError>(HasSubstr("mixes 'None' with mesh dim names")));
  EXPECT_THAT([&] { Layout::from_tensor_map(mesh, {{2}}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("tensor_map entry 2 of tensor dim 0 is out of range for a 2-d mesh")));
  EXPECT_THAT([&] { Layout(mesh, {Partial(), Replicate()}).alias_placements(1); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("the alias form cannot express P(sum) on mesh dim 'dp'")));
  EXPECT_THAT([&] { Layout(mesh, {Shard(0)}); },
              ThrowsMessage<ArgumentError>(HasSubstr("1 placements [S(0)] given for a 2-d mesh")));
  EXPECT_THAT(
      [&] {
        Layout(mesh, ShardSpec{{Shard(0), Replicate()}, {{0, {0, 1}}}});
      },
      ThrowsMessage<ArgumentError>(
          HasSubstr("shard order [0, 1] of tensor dim 0 must list exactly the mesh dims [0]")));
}

// Plans are mesh-independent: test them on specs directly.
TEST(RedistributePlan, ChoosesTheExpectedCollectives) {
  auto plan = [](Placements a, Placements b) {
    return plan_redistribute(ShardSpec{std::move(a), {}}, ShardSpec{std::move(b), {}});
  };
  const Placement R = Replicate(), S0 = Shard(0), S1 = Shard(1), P = Partial();
  using K = RedistributeStep::Kind;
  auto kinds = [](const std::shared_ptr<const RedistributePlan>& p) {
    std::vector<K> k;
    for (const auto& s : p->steps()) k.push_back(s.kind);
    return k;
  };
  EXPECT_EQ(kinds(plan({S0}, {R})), std::vector<K>{K::kAllGather});
  EXPECT_EQ(kinds(plan({R}, {S0})), std::vector<K>{K::kChunk});
  EXPECT_EQ(plan({R}, {S0})->num_collectives(), 0);
  EXPECT_EQ(kinds(plan({P}, {R})), std::vector<K>{K::kAllReduce});
  EXPECT_EQ(kinds(plan({P}, {S1})), std::vector<K>{K::kReduceScatter});
  EXPECT_EQ(kinds(plan({S0}, {S1})), std::vector<K>{K::kAllToAll});
  EXPECT_EQ(kinds(plan({R}, {P})), std::vector<K>{K::kPartition});
  EXPECT_EQ(kinds(plan({S0}, {P})), (std::vector<K>{K::kAllGather, K::kPartition}));
  EXPECT_EQ(kinds(plan({Partial("max")}, {P})), (std::vector<K>{K::kAllReduce, K::kPartition}));
  EXPECT_TRUE(plan({S0, S1}, {S0, S1})->steps().empty());
  // Partial dims are reduced while the data is still sharded, before gathers.
  EXPECT_EQ(kinds(plan({P, S0}, {R, R})), (std::vector<K>{K::kAllReduce, K::kAllGather}));
  // Multi-axis: the inner level (mesh dim 1) is undone before the outer one.
  auto multi = plan({S0, S0}, {R, R});
  ASSERT_EQ(multi->steps().size(), 2u);
  EXPECT_EQ(multi->steps()[0].mesh_dim, 1);
  EXPECT_EQ(multi->steps()[1].mesh_dim, 0);
  // Moving a shard level between mesh dims of one tensor dim.
  EXPECT_EQ(kinds(plan({S0, R}, {R, S0})), (std::vector<K>{K::kAllGather, K::kChunk}));
  EXPECT_EQ(kinds(plan({S0, S1}, {S1, S0})),
            (std::vector<K>{K::kAllGather, K::kAllToAll, K::kChunk}));
}

TEST(RedistributePlan, ExplainNamesEveryStep) {
  auto p = plan_redistribute(ShardSpec{{Partial(), Shard(0)}, {}},
                             ShardSpec{{Shard(1), Replicate()}, {}});
  std::string e = p->explain();
  EXPECT_THAT(e, HasSubstr("redistribute [P(sum), S(0)] -> [S(1), R]"));
  EXPECT_THAT(e, HasSubstr("mesh dim 1: S(0) -> R  all_gather along tensor dim 0"));
  EXPECT_THAT(e, HasSubstr("mesh dim 0: P(sum) -> S(1)  reduce_scatter(sum) along tensor dim 1"));
  auto same = plan_redistribute(ShardSpec{{Replicate()}, {}}, ShardSpec{{Replicate()}, {}});
  EXPECT_THAT(same->explain(), HasSubstr("nothing to do"));
}

}  // namespace
}  // namespace hp
