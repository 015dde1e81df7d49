// The DTensor API (T3, T5): distribute_tensor, from_local (with and
// without run_check), shapes and offsets, full_tensor, explain and the plan
// cache, and the argument errors.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hp/distributed/world.h"
#include "hp/tensor/dtensor.h"
#include "hp/tensor/redistribute_plan.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"
#include "tests/tensor/comm_counter.h"
#include "tests/tensor/reference.h"
#include "tests/tensor/world_mesh.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StrEq;
using ::testing::ThrowsMessage;
using test::tensors_equal;


using test::world_mesh;

TEST(DTensor, DistributeTensorSlicesWithoutCommunication) {
  auto mesh = world_mesh();
  const int64_t w = dist::get_world_size(), r = dist::get_rank();
  // 3 rows over up to 4 ranks: torch.chunk leaves the last ranks empty.
  at::Tensor full = test::integer_tensor({3, 2}).requires_grad_(true);
  test::CommCounter counter;
  DTensor d = distribute_tensor(full, mesh, {Shard(0)});
  DTensor p = distribute_tensor(full, mesh, {Partial("sum")});
  EXPECT_EQ(counter.delta().total(), 0);
  auto pieces = at::chunk(full.detach(), w, 0);
  at::Tensor expected = r < int64_t(pieces.size()) ? pieces[r] : full.detach().narrow(0, 3, 0);
  EXPECT_TRUE(tensors_equal(d.local(), expected.contiguous()));
  EXPECT_TRUE(d.local().requires_grad());
  EXPECT_TRUE(d.local().is_leaf());
  EXPECT_EQ(d.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(d.numel(), 6);
  EXPECT_EQ(d.dim(), 2);
  EXPECT_EQ(d.strides(), (std::vector<int64_t>{2, 1}));
  const int64_t chunk = (3 + w - 1) / w;
  EXPECT_EQ(d.local_offset(), (std::vector<int64_t>{std::min<int64_t>(3, chunk * r), 0}));
  EXPECT_TRUE(tensors_equal(d.full_tensor(), full.detach()));
}

TEST(DTensor, DistributePartialPartitionsTheValue) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor({4, 3});
  DTensor sum = distribute_tensor(full, mesh, {Partial("sum")});
  EXPECT_TRUE(tensors_equal(sum.local(), dist::get_rank() == 0 ? full : at::zeros_like(full)));
  EXPECT_TRUE(tensors_equal(sum.full_tensor(), full));
  DTensor max = distribute_tensor(full, mesh, {Partial("max")});
  EXPECT_TRUE(tensors_equal(max.local(), full));
  EXPECT_TRUE(tensors_equal(max.full_tensor(), full));
}

TEST(DTensor, FromLocalInfersEvenShapes) {
  auto mesh = world_mesh();
  const int64_t w = dist::get_world_size();
  DTensor d = from_local(at::ones({2, 3}), mesh, {Shard(1)});
  EXPECT_EQ(d.sizes(), (std::vector<int64_t>{2, 3 * w}));
  DTensor r = from_local(at::ones({2, 3}), mesh, {Replicate()});
  EXPECT_EQ(r.sizes(), (std::vector<int64_t>{2, 3}));
}

TEST(DTensor, FromLocalRunCheckInfersUnevenShapes) {
  auto mesh = world_mesh();
  const int64_t w = dist::get_world_size(), r = dist::get_rank();
  // 2w + 1 rows split by torch.chunk.
  const int64_t rows = 2 * w + 1;
  Span s = chunk_span(rows, w, r);
  DTensor d = from_local(at::ones({s.size, 4}), mesh, {Shard(0)}, {std::nullopt, true});
  EXPECT_EQ(d.sizes(), (std::vector<int64_t>{rows, 4}));
  EXPECT_EQ(d.local_offset()[0], s.offset);
}

TEST(DTensor, FromLocalRunCheckRejectsInconsistentShapesOnEveryRank) {
  auto mesh = world_mesh();
  if (dist::get_world_size() < 2) GTEST_SKIP();
  // Every rank holds 2 rows except the last, which holds 3: not torch.chunk.
  const bool last = dist::get_rank() == dist::get_world_size() - 1;
  at::Tensor local = at::ones({last ? 3 : 2, 4});
  EXPECT_THAT([&] { from_local(local, mesh, {Shard(0)}, {std::nullopt, true}); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("from_local: rank "),
                                                 HasSubstr("holds a local tensor of shape"),
                                                 HasSubstr("[S(0)] of global shape"))));
}

TEST(DTensor, FromLocalRunCheckWithShapeRaisesOnEveryRank) {
  auto mesh = world_mesh();
  const int64_t w = dist::get_world_size(), r = dist::get_rank();
  if (w < 2) GTEST_SKIP();
  // 2w rows: every rank should hold 2; the last holds 3. With run_check the
  // gathered table is checked, so every rank (not just the last) raises the
  // same message instead of the others waiting for it in a collective.
  const bool last = r == w - 1;
  at::Tensor local = at::ones({last ? 3 : 2, 4});
  const std::string expected =
      "from_local: rank " + std::to_string(w - 1) + " (coordinate [" + std::to_string(w - 1) +
      "]) holds a local tensor of shape [3, 4] but [S(0)] of global shape [" +
      std::to_string(2 * w) + ", 4] gives it [2, 4]";
  EXPECT_THAT(
      [&] { from_local(local, mesh, {Shard(0)}, {std::vector<int64_t>{2 * w, 4}, true}); },
      ThrowsMessage<ArgumentError>(StrEq(expected)));
  // The ranks still agree afterwards: a well-formed call goes through.
  DTensor d =
      from_local(at::ones({2, 4}), mesh, {Shard(0)}, {std::vector<int64_t>{2 * w, 4}, true});
  EXPECT_EQ(d.sizes(), (std::vector<int64_t>{2 * w, 4}));
}

TEST(DTensor, FromLocalRunCheckRejectsDifferentNdimsOnEveryRank) {
  auto mesh = world_mesh();
  const int64_t w = dist::get_world_size(), r = dist::get_rank();
  if (w < 2) GTEST_SKIP();
  // The last rank's local tensor has an extra dim: shapes of different
  // lengths cannot be gathered, so the ndims are compared first.
  at::Tensor local = r == w - 1 ? at::ones({2, 4, 1}) : at::ones({2, 4});
  for (bool with_shape : {false, true}) {
    FromLocalOptions options;
    options.run_check = true;
    if (with_shape) options.shape = std::vector<int64_t>{2 * w, 4};
    EXPECT_THAT([&] { from_local(local, mesh, {Shard(0)}, options); },
                ThrowsMessage<ArgumentError>(StrEq(
                    "from_local: rank " + std::to_string(w - 1) + " (coordinate [" +
                    std::to_string(w - 1) +
                    "]) holds a local tensor with 3 dims but rank 0 (coordinate [0]) holds one "
                    "with 2; expected every rank's local tensor to have the global tensor's dims")))
        << "with_shape " << with_shape;
  }
  // An undefined local tensor on one rank also raises everywhere.
  EXPECT_THAT(
      [&] {
        from_local(r == 0 ? at::Tensor() : at::ones({2, 4}), mesh, {Shard(0)},
                   {std::nullopt, true});
      },
      ThrowsMessage<ArgumentError>(
          StrEq("from_local: rank 0 (coordinate [0]) passed an undefined local tensor; expected a "
                "tensor on every rank")));
}

TEST(DTensor, FromLocalWithShapeChecksThisRanksPiece) {
  auto mesh = world_mesh();
  EXPECT_THAT([&] { from_local(at::ones({5, 2}), mesh, {Shard(0)}, {std::vector<int64_t>{1, 2}}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("does not fit [S(0)] of global shape [1, 2]")));
  EXPECT_THAT([&] { from_local(at::ones({5, 2}), mesh, {Shard(0)}, {std::vector<int64_t>{5}}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("shape [5] has 1 dims but the local tensor has 2")));
}

TEST(DTensor, RedistributeToTheSameLayoutIsFree) {
  auto mesh = world_mesh();
  DTensor d = distribute_tensor(test::integer_tensor({4, 4}), mesh, {Shard(0)});
  DTensor same = d.redistribute({Shard(-2)});
  EXPECT_TRUE(same.local().is_same(d.local()));
}

TEST(DTensor, ExplainAndThePlanCache) {
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"dp"});
  DTensor d = distribute_tensor(test::integer_tensor({8, 4}), mesh, {Shard(0)});
  std::string e = d.explain(Layout(mesh, {Replicate()}));
  EXPECT_THAT(e, HasSubstr("redistribute [S(0)] -> [R]: 1 step(s), 1 collective(s)"));
  EXPECT_THAT(e, HasSubstr("mesh dim 0 ('dp', " + std::to_string(dist::get_world_size()) +
                           " ranks): S(0) -> R  all_gather along tensor dim 0"));
  clear_plan_cache();
  d.redistribute({Replicate()});
  d.redistribute({Replicate()});
  d.redistribute({Replicate()});
  PlanCacheStats stats = plan_cache_stats();
  EXPECT_EQ(stats.misses, 1);
  EXPECT_EQ(stats.hits, 2);
  EXPECT_EQ(stats.size, 1);
}

TEST(DTensor, AliasRedistributeAndStr) {
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"dp"});
  DTensor d = distribute_tensor(test::integer_tensor({6, 4}), mesh, {Replicate()});
  DTensor s = d.redistribute(AliasPlacements{{"None"}, {"dp"}});
  EXPECT_EQ(s.placements(), (Placements{Shard(1)}));
  EXPECT_THAT(s.str(), HasSubstr("DTensor(shape [6, 4], Layout(mesh ['dp']"));
}

TEST(DTensorErrors, ArgumentErrorsNameTheProblem) {
  auto mesh = world_mesh();
  at::Tensor t = at::ones({4, 4});
  EXPECT_THAT([&] { distribute_tensor(t, mesh, {Shard(0), Replicate()}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("Layout: 2 placements [S(0), R] given for a 1-d mesh ['x']")));
  EXPECT_THAT([&] { distribute_tensor(t, mesh, {Shard(2)}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("S(2) on mesh dim 'x' is out of range for a tensor with 2 dims")));
  EXPECT_THAT([&] { distribute_tensor(t, mesh, {Shard(-3)}); },
              ThrowsMessage<ArgumentError>(HasSubstr("S(-3) on mesh dim 'x' is out of range")));
  EXPECT_THAT([&] { Partial("prod"); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "Partial reduce_op must be one of ['sum', 'avg', 'max', 'min'] but got 'prod'")));
  EXPECT_THAT([&] { distribute_tensor(at::Tensor(), mesh, {Shard(0)}); },
              ThrowsMessage<ArgumentError>(HasSubstr("distribute_tensor: tensor is undefined")));
  auto other = init_device_mesh("cpu", {1, dist::get_world_size()}, {"a", "b"});
  DTensor d = distribute_tensor(t, mesh, {Shard(0)});
  EXPECT_THAT([&] { d.redistribute(Layout(other, {Replicate(), Replicate()})); },
              ThrowsMessage<ArgumentError>(AllOf(HasSubstr("redistribute: the target mesh"),
                                                 HasSubstr("differs from the DTensor's mesh"))));
  EXPECT_THAT(
      [&] { d.redistribute(AliasPlacements{{"x"}}); },
      ThrowsMessage<ArgumentError>(HasSubstr("alias placements have 1 entries for a 2-d DTensor")));
  EXPECT_THAT([&] { DTensor().to_local(); },
              ThrowsMessage<ArgumentError>(HasSubstr("to_local: the DTensor is undefined")));
}

}  // namespace
}  // namespace hp
