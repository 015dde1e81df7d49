// Gradients through from_local / redistribute / to_local (T6) against
// single-process autograd: every rank computes the whole tensor's gradient
// for the equivalent global loss and compares its slice with the local
// gradient. Values are small integers, so gradients are exact. Tests named
// after a collective also count the collectives of the forward and backward.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "hp/distributed/world.h"
#include "hp/tensor/dtensor.h"
#include "hp/util/error.h"
#include "tests/support/tensor_checks.h"
#include "tests/tensor/comm_counter.h"
#include "tests/tensor/reference.h"
#include "tests/tensor/world_mesh.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::CommCounter;
using test::PartialStyle;
using test::tensors_equal;

// Exactly `n` collectives of kind `op` and none of any other kind.
testing::AssertionResult only(const dist::CommStats& s, dist::OpType op, int64_t n) {
  if (s[op] == n && s.total() == n) return testing::AssertionSuccess();
  return testing::AssertionFailure() << "expected " << n << " " << dist::op_name(op)
                                     << "(s) and no other collective; got "
                                     << s.describe_calls();
}

testing::AssertionResult none(const dist::CommStats& s) {
  return only(s, dist::OpType::kAllGather, 0);
}

using test::world_mesh;

// The slice of `full` this rank holds under `placements` (Partial dims
// partitioned by the test's pieces).
at::Tensor slice_of(const at::Tensor& full, const DeviceMeshPtr& mesh, const Placements& pl) {
  Layout layout(mesh, pl);
  std::vector<PartialStyle> styles(mesh->ndim(), PartialStyle::kTestPieces);
  return test::reference_local(full, layout.normalized(full.dim()), mesh->coordinate(), styles);
}

// A leaf holding this rank's slice.
at::Tensor leaf(const at::Tensor& full, const DeviceMeshPtr& mesh, const Placements& pl) {
  return slice_of(full, mesh, pl).clone().requires_grad_(true);
}

// The global gradient of sum_r (X * W_r) where W_r are per-rank weights.
at::Tensor weight_of(int rank, at::IntArrayRef shape) {
  return test::integer_tensor(shape, 100 + rank);
}

at::Tensor sum_of_weights(at::IntArrayRef shape) {
  at::Tensor total = at::zeros(shape);
  for (int r = 0; r < dist::get_world_size(); ++r) total += weight_of(r, shape);
  return total;
}

const std::vector<int64_t> kShape = {7, 5};

TEST(Autograd, ShardToReplicateWithReplicateGradientIsAChunk) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape);  // the same on every rank: one global loss
  at::Tensor x = leaf(full, mesh, {Shard(0)});
  CommCounter forward;
  at::Tensor y = from_local(x, mesh, {Shard(0)}, {kShape}).redistribute({Replicate()}).to_local();
  EXPECT_TRUE(only(forward.delta(), dist::OpType::kAllGather, 1));
  CommCounter backward;
  (y * w).sum().backward();
  EXPECT_TRUE(none(backward.delta()));
  // Single process: d/dX sum(X * W) = W.
  EXPECT_TRUE(tensors_equal(x.grad(), slice_of(w, mesh, {Shard(0)})));
}

TEST(Autograd, ShardToReplicateWithPartialGradientReduceScatters) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor x = leaf(full, mesh, {Shard(0)});
  at::Tensor y = from_local(x, mesh, {Shard(0)}, {kShape})
                     .redistribute({Replicate()})
                     .to_local(Placements{Partial()});
  // Each rank's own loss; the global loss is their sum.
  CommCounter backward;
  (y * weight_of(dist::get_rank(), kShape)).sum().backward();
  EXPECT_TRUE(only(backward.delta(), dist::OpType::kReduceScatter, 1));
  EXPECT_TRUE(tensors_equal(x.grad(), slice_of(sum_of_weights(kShape), mesh, {Shard(0)})));
}

TEST(Autograd, PartialToReplicateIsIdentity) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape);
  at::Tensor x = leaf(full, mesh, {Partial("sum")});
  CommCounter forward;
  at::Tensor y = from_local(x, mesh, {Partial()}).redistribute({Replicate()}).to_local();
  EXPECT_TRUE(only(forward.delta(), dist::OpType::kAllReduce, 1));
  EXPECT_TRUE(tensors_equal(y, full));
  CommCounter backward;
  (y * w).sum().backward();
  EXPECT_TRUE(none(backward.delta()));
  // X = sum_r x_r, so every partial value gets the whole gradient.
  EXPECT_TRUE(tensors_equal(x.grad(), w));
}

TEST(Autograd, PartialAverageScalesByGroupSize) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape) * dist::get_world_size();
  at::Tensor x = leaf(full, mesh, {Partial("avg")});
  CommCounter forward;
  at::Tensor y = from_local(x, mesh, {Partial("avg")}).redistribute({Replicate()}).to_local();
  EXPECT_TRUE(only(forward.delta(), dist::OpType::kAllReduce, 1));
  EXPECT_TRUE(tensors_equal(y, full));
  CommCounter backward;
  (y * w).sum().backward();
  EXPECT_TRUE(none(backward.delta()));
  EXPECT_TRUE(tensors_equal(x.grad(), w / dist::get_world_size()));
}

TEST(Autograd, ReplicateToShardGathersTheGradient) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape);
  at::Tensor x = full.clone().requires_grad_(true);
  CommCounter forward;
  DTensor y = from_local(x, mesh, {Replicate()}).redistribute({Shard(0)});
  EXPECT_TRUE(none(forward.delta()));  // R -> S(0) is a local chunk
  // Each rank's loss covers its own shard: together they are sum(X * W).
  CommCounter backward;
  (y.to_local() * slice_of(w, mesh, {Shard(0)})).sum().backward();
  EXPECT_TRUE(only(backward.delta(), dist::OpType::kAllGather, 1));
  EXPECT_TRUE(tensors_equal(x.grad(), w));
}

TEST(Autograd, ShardToOtherShardIsAllToAll) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape);
  at::Tensor x = leaf(full, mesh, {Shard(0)});
  CommCounter forward;
  DTensor y = from_local(x, mesh, {Shard(0)}, {kShape}).redistribute({Shard(1)});
  EXPECT_TRUE(only(forward.delta(), dist::OpType::kAllToAll, 1));
  CommCounter backward;
  (y.to_local() * slice_of(w, mesh, {Shard(1)})).sum().backward();
  EXPECT_TRUE(only(backward.delta(), dist::OpType::kAllToAll, 1));
  EXPECT_TRUE(tensors_equal(x.grad(), slice_of(w, mesh, {Shard(0)})));
}

TEST(Autograd, ReplicateToPartialWithReplicateGradient) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape);
  at::Tensor x = full.clone().requires_grad_(true);
  CommCounter forward;
  at::Tensor y = from_local(x, mesh, {Replicate()})
                     .redistribute({Partial()})
                     .to_local(Placements{Replicate()});
  EXPECT_TRUE(none(forward.delta()));  // R -> P is a local partition
  // sum_r (y_r * W) = (X * W) since the y_r add up to X.
  CommCounter backward;
  (y * w).sum().backward();
  EXPECT_TRUE(none(backward.delta()));  // a Replicate gradient of R -> P is the gradient
  EXPECT_TRUE(tensors_equal(x.grad(), w));
}

TEST(Autograd, FullTensorGradient) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  at::Tensor w = weight_of(0, kShape);
  at::Tensor x = leaf(full, mesh, {Shard(1)});
  at::Tensor y = from_local(x, mesh, {Shard(1)}, {kShape}).full_tensor();
  EXPECT_TRUE(tensors_equal(y, full));
  (y * w).sum().backward();
  EXPECT_TRUE(tensors_equal(x.grad(), slice_of(w, mesh, {Shard(1)})));
}

TEST(Autograd, ChainOnTwoDimensionalMesh) {
  const int world = dist::get_world_size();
  std::vector<int64_t> shape = world % 2 == 0 ? std::vector<int64_t>{2, world / 2}
                                              : std::vector<int64_t>{world, 1};
  auto mesh = init_device_mesh("cpu", shape, {"dp", "tp"});
  at::Tensor full = test::integer_tensor(kShape);
  // [S(0), S(1)] -> [R, S(0)] -> [R, R], each rank with its own loss.
  at::Tensor x = leaf(full, mesh, {Shard(0), Shard(1)});
  at::Tensor y = from_local(x, mesh, {Shard(0), Shard(1)}, {kShape})
                     .redistribute({Replicate(), Shard(0)})
                     .redistribute({Replicate(), Replicate()})
                     .to_local(Placements{Partial(), Partial()});
  (y * weight_of(dist::get_rank(), kShape)).sum().backward();
  EXPECT_TRUE(tensors_equal(x.grad(), slice_of(sum_of_weights(kShape), mesh,
                                               {Shard(0), Shard(1)})));
}

TEST(Autograd, FromLocalBackwardRedistributesToItsPlacements) {
  auto mesh = world_mesh();
  at::Tensor full = test::integer_tensor(kShape);
  // Replicate input whose gradient each rank declares Partial: from_local's
  // backward sums the contributions (all-reduce) so every replica gets it all.
  at::Tensor x = full.clone().requires_grad_(true);
  at::Tensor y = from_local(x, mesh, {Replicate()}).to_local(Placements{Partial()});
  CommCounter backward;
  (y * weight_of(dist::get_rank(), kShape)).sum().backward();
  EXPECT_TRUE(only(backward.delta(), dist::OpType::kAllReduce, 1));
  EXPECT_TRUE(tensors_equal(x.grad(), sum_of_weights(kShape)));
}

TEST(AutogradErrors, PartialMaxIsNotDifferentiable) {
  auto mesh = world_mesh();
  at::Tensor x = test::integer_tensor(kShape).requires_grad_(true);
  DTensor d = from_local(x, mesh, {Partial("max")});
  EXPECT_THAT([&] { d.redistribute({Replicate()}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("P(max) on mesh dim 'x' that requires grad cannot be differentiated")));
  // Without grad it is an ordinary max reduction.
  at::NoGradGuard no_grad;
  EXPECT_NO_THROW(d.redistribute({Replicate()}));
}

TEST(AutogradErrors, PartialMaxTargetIsNotDifferentiable) {
  auto mesh = world_mesh();
  at::Tensor x = test::integer_tensor(kShape).requires_grad_(true);
  DTensor d = from_local(x, mesh, {Replicate()});
  // Refused before the plan runs: no rank issues a collective.
  CommCounter counter;
  EXPECT_THAT([&] { d.redistribute({Partial("max")}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("redistribute: a target layout with P(max) on mesh dim 'x' for a "
                            "DTensor that requires grad cannot be differentiated")));
  EXPECT_THAT(
      [&] { d.redistribute({Partial("min")}); },
      ThrowsMessage<ArgumentError>(HasSubstr(
          "P(min) on mesh dim 'x' for a DTensor that requires grad cannot be differentiated")));
  EXPECT_EQ(counter.delta().total(), 0);
  // The source refusal also comes before any collective.
  DTensor p = from_local(x, mesh, {Partial("max")});
  EXPECT_THROW(p.redistribute({Replicate()}), ArgumentError);
  EXPECT_EQ(counter.delta().total(), 0);
  at::NoGradGuard no_grad;
  EXPECT_NO_THROW(d.redistribute({Partial("max")}));
}

TEST(AutogradErrors, PartialMaxGradPlacementsAreRefused) {
  auto mesh = world_mesh();
  at::Tensor x = test::integer_tensor(kShape).requires_grad_(true);
  DTensor d = from_local(x, mesh, {Replicate()});
  EXPECT_THAT([&] { d.to_local(Placements{Partial("max")}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("to_local: grad_placements with P(max) on mesh dim 'x' for a DTensor "
                            "that requires grad cannot be differentiated")));
  // The DTensor's own P(max) layout passes its gradient through unchanged.
  DTensor p = from_local(x, mesh, {Partial("max")});
  EXPECT_NO_THROW(p.to_local(Placements{Partial("max")}));
}

TEST(AutogradErrors, ConflictingGradientLayoutsAreRefused) {
  auto mesh = world_mesh();
  at::Tensor x = test::integer_tensor(kShape).requires_grad_(true);
  DTensor d = from_local(x, mesh, {Partial()});
  d.redistribute({Replicate()});
  EXPECT_THAT(
      [&] { d.to_local(); },
      ThrowsMessage<ArgumentError>(HasSubstr("to_local() would send back a gradient laid out as "
                                             "[P(sum)] but redistribute() already declared [R]")));
}

TEST(AutogradErrors, GradPlacementsMustKeepTheLocalShape) {
  auto mesh = world_mesh();
  at::Tensor x = test::integer_tensor({8, 4}).requires_grad_(true);
  DTensor d = from_local(x, mesh, {Replicate()});
  if (dist::get_world_size() == 1) GTEST_SKIP();
  EXPECT_THAT([&] { d.to_local(Placements{Shard(0)}); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "to_local: grad_placements [S(0)] give this rank a gradient of shape")));
}

}  // namespace
}  // namespace hp
