// shard_module (S1, S2) with a multi-axis alias tuple in the plan: one
// tensor dim sharded over both dims of a (dp, tp) mesh, {"dp", "tp"} with
// "tp" varying fastest, against the same MLP in one process. Pieces are
// compared exactly (they are copies); outputs and gradients within the
// bounds tests/tp/tp_mlp.h derives (fc2's sum over the hidden width split
// into per-rank partial sums, as with one mesh dim).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/shard_module.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"
#include "tests/tp/tp_mlp.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

using test::TpMlp;
using test::whole;
using test::within_bound;

TEST(ShardModule, MultiAxisAliasTupleShardsOneDimOverBothMeshDims) {
  const int64_t w = dist::get_world_size();
  // 2 x 2 on 4 ranks, 2 x 1 on 2, 1 x 3 on 3: both dims are real where
  // the world allows it.
  const int64_t dp = w % 2 == 0 ? 2 : 1;
  auto mesh = init_device_mesh("cpu", {dp, w / dp}, {"dp", "tp"});
  // A hidden width of 12 splits evenly over 1-4 ranks, so the nested split
  // equals one split over the flattened ranks.
  torch::manual_seed(7);
  TpMlp model(6, 12);
  torch::manual_seed(7);
  TpMlp ref(6, 12);
  ShardingPlan plan;
  plan.plan = {{"fc1.weight", {PlanDim{"dp", "tp"}, "None"}},
               {"fc1.bias", {PlanDim{"dp", "tp"}}},
               {"fc2.weight", {"None", PlanDim{"dp", "tp"}}},
               {"fc2.bias", {"None"}}};
  plan.input_plan = {{"input", {"None", "None"}}};
  plan.output_plan = {{"output", {"None", "None"}}};
  shard_module(model, mesh, plan);

  // Both mesh dims shard dim 0 of fc1.weight: each rank holds rows
  // [r * 12 / w, +12 / w) for its row-major rank r = dp_coord * tp + tp_coord.
  const int64_t r = mesh->coordinate()[0] * (w / dp) + mesh->coordinate()[1];
  ASSERT_EQ(r, dist::get_rank());
  const int64_t rows = 12 / w;
  if (w > 1) {
    ASSERT_TRUE(is_dtensor(model->fc1->weight));
    EXPECT_EQ(layout_of(model->fc1->weight), Layout(mesh, {Shard(0), Shard(0)}));
    EXPECT_EQ(layout_of(model->fc2->weight), Layout(mesh, {Shard(1), Shard(1)}));
    EXPECT_EQ(layout_of(model->fc2->bias), Layout(mesh, {Replicate(), Replicate()}));
    EXPECT_TRUE(test::tensors_equal(local_of(model->fc1->weight),
                                    ref->fc1->weight.detach().narrow(0, r * rows, rows)));
    EXPECT_TRUE(test::tensors_equal(local_of(model->fc1->bias),
                                    ref->fc1->bias.detach().narrow(0, r * rows, rows)));
    EXPECT_TRUE(test::tensors_equal(local_of(model->fc2->weight),
                                    ref->fc2->weight.detach().narrow(1, r * rows, rows)));
  }

  torch::manual_seed(3);
  const at::Tensor x = torch::randn({5, 6}), y = torch::randn({5, 6});
  const test::MlpBounds bounds = test::mlp_bounds(ref, x, y);
  at::Tensor out = model(x);
  EXPECT_TRUE(within_bound(whole(out), ref(x), bounds.out));
  at::Tensor diff = out - y;
  (diff * diff).mean().backward();
  at::Tensor ref_diff = ref(x) - y;
  (ref_diff * ref_diff).mean().backward();
  auto ref_params = ref->named_parameters();
  for (auto& item : model->named_parameters()) {
    EXPECT_TRUE(within_bound(whole(item.value().grad()), ref_params[item.key()].grad(),
                             bounds.grad.at(item.key())))
        << item.key();
  }
}

}  // namespace
}  // namespace hp
