// parallelize_value_and_grad (S5): the gradients it returns for DTensor
// losses (Replicate, Shard and Partial; one output or several, with and
// without sensitivities) equal a single process's, and a sens count that
// does not match is an error.
//
// The MLP case runs on random floats and is held to tests/tp/tp_mlp.h's
// bounds. The others run on integers in {-1, 0, 1} (parameters and data)
// and sensitivities that are powers of two: every product and partial sum
// is then an integer or half-integer far below 2^24, which float represents
// exactly, so both runs compute exact values whatever their order and must
// agree exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/shard_module.h"
#include "hp/tp/value_and_grad.h"
#include "hp/util/error.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"
#include "tests/tp/tp_mlp.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::make_tp_mlp;
using test::tensors_equal;
using test::TpMlp;
using test::within_bound;

using test::world_size;

using test::tp_mesh;
using test::whole;

ShardingPlan mlp_plan(const Placements& output) {
  ShardingPlan plan;
  plan.plan = {{"fc1.weight", {Shard(0)}},
               {"fc1.bias", {Shard(0)}},
               {"fc2.weight", {Shard(1)}},
               {"fc2.bias", {Replicate()}}};
  plan.output_plan = {{"output", output}};
  return plan;
}

at::Tensor ints(at::IntArrayRef sizes) { return torch::randint(-1, 2, sizes).to(at::kFloat); }

// The MLP with integer parameters.
TpMlp integer_mlp() {
  TpMlp model = make_tp_mlp();
  torch::manual_seed(11);
  at::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.copy_(ints(p.sizes()));
  return model;
}

void expect_grads_equal(const nn::TensorList& grads, const nn::TensorList& expected) {
  ASSERT_EQ(grads.size(), expected.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    SCOPED_TRACE(testing::Message() << "weight " << i);
    ASSERT_TRUE(grads[i].defined());
    EXPECT_TRUE(tensors_equal(whole(grads[i]), expected[i]));
  }
}

TEST(ValueAndGrad, MlpGradientsMatchOneProcess) {
  auto mesh = tp_mesh();
  TpMlp model = make_tp_mlp(), ref = make_tp_mlp();
  shard_module(model, mesh, mlp_plan({Replicate()}));
  torch::manual_seed(21);
  const at::Tensor x = torch::randn({5, 6}), y = torch::randn({5, 6});
  auto mse = [](const at::Tensor& out, const at::Tensor& target) {
    at::Tensor diff = out - target;
    return (diff * diff).mean();
  };
  auto step = parallelize_value_and_grad(
      [&](const at::Tensor& input, const at::Tensor& target) { return mse(model(input), target); },
      model->parameters());
  auto [loss, grads] = step(x, y);

  const test::MlpBounds bounds = test::mlp_bounds(ref, x, y);
  at::Tensor ref_loss = mse(ref(x), y);
  ref_loss.backward();
  EXPECT_TRUE(within_bound(whole(loss).item<double>(), ref_loss.item<double>(), bounds.loss));
  auto names = model->named_parameters().keys();
  auto ref_params = ref->named_parameters();
  ASSERT_EQ(grads.size(), names.size());
  for (size_t i = 0; i < names.size(); ++i) {
    SCOPED_TRACE(names[i]);
    ASSERT_TRUE(grads[i].defined());
    if (world_size() > 1) {
      ASSERT_TRUE(is_dtensor(grads[i]));
      EXPECT_EQ(layout_of(grads[i]), layout_of(model->named_parameters()[names[i]]))
          << layout_of(grads[i]).str();
    }
    EXPECT_TRUE(within_bound(whole(grads[i]), ref_params[names[i]].grad(), bounds.grad.at(names[i])));
    // Returned, not accumulated.
    EXPECT_FALSE(model->named_parameters()[names[i]].grad().defined());
  }
}

TEST(ValueAndGrad, SeveralOutputsAndSensitivities) {
  auto mesh = tp_mesh();
  TpMlp model = integer_mlp(), ref = integer_mlp();
  shard_module(model, mesh, mlp_plan({Replicate()}));
  torch::manual_seed(22);
  const at::Tensor x = ints({5, 6}), y = ints({5, 6});
  auto outputs = [&](auto& m) {
    at::Tensor out = m(x);
    at::Tensor diff = out - y;
    return nn::TensorList{(diff * diff).sum(), out.sum()};
  };
  // The single process: the sensitivities' combination, differentiated.
  auto expected = [&](double s0, double s1) {
    nn::TensorList values = outputs(ref);
    return torch::autograd::grad({values[0] * s0 + values[1] * s1}, ref->parameters());
  };

  auto first_only = parallelize_value_and_grad([&] { return outputs(model); }, model->parameters());
  auto [values, grads] = first_only();
  ASSERT_EQ(values.size(), 2u);
  nn::TensorList ref_values = outputs(ref);
  EXPECT_TRUE(tensors_equal(whole(values[0]), ref_values[0].detach()));
  EXPECT_TRUE(tensors_equal(whole(values[1]), ref_values[1].detach()));
  expect_grads_equal(grads, expected(1.0, 0.0));

  for (auto [s0, s1] : {std::pair{0.5, 2.0}, std::pair{0.0, 1.0}}) {
    SCOPED_TRACE(testing::Message() << "sens " << s0 << ", " << s1);
    auto weighted = parallelize_value_and_grad([&] { return outputs(model); },
                                               model->parameters(), {s0, s1});
    expect_grads_equal(weighted().grads, expected(s0, s1));
  }

  auto wrong = parallelize_value_and_grad([&] { return outputs(model); }, model->parameters(),
                                          {1.0, 0.0, 0.0});
  EXPECT_THAT([&] { wrong(); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "sens has 3 values but fn returned 2 outputs; expected one sensitivity per output")));
}

TEST(ValueAndGrad, ShardedLoss) {
  auto mesh = tp_mesh();
  TpMlp model = integer_mlp(), ref = integer_mlp();
  // The output split by rows: each row's loss lives on one rank.
  shard_module(model, mesh, mlp_plan({Shard(0)}));
  torch::manual_seed(23);
  const at::Tensor x = ints({5, 6}), y = ints({5, 6});
  auto row_losses = [&](auto& m) {
    at::Tensor diff = m(x) - y;
    return (diff * diff).sum(1);
  };
  auto [loss, grads] =
      parallelize_value_and_grad([&] { return row_losses(model); }, model->parameters())();
  if (world_size() > 1) {
    EXPECT_EQ(layout_of(loss), Layout(mesh, {Shard(0)}));
  }
  at::Tensor ref_loss = row_losses(ref);
  EXPECT_TRUE(tensors_equal(whole(loss), ref_loss.detach()));
  expect_grads_equal(grads, torch::autograd::grad({ref_loss}, ref->parameters(),
                                                  {torch::ones_like(ref_loss)}));
}

TEST(ValueAndGrad, PartialLoss) {
  auto mesh = tp_mesh();
  torch::manual_seed(24);
  const at::Tensor x = ints({3, 6}), w_full = ints({4, 6}).requires_grad_();
  const bool distributed = world_size() > 1;
  // Contracting over a dim both operands shard leaves each rank a partial
  // sum; the loss is that Partial scalar, never reduced in forward.
  const at::Tensor w = distributed ? distribute(w_full, Layout(mesh, {Shard(1)})) : w_full;
  const at::Tensor xs = distributed ? distribute(x, Layout(mesh, {Shard(1)})) : x;
  auto [loss, grads] = parallelize_value_and_grad(
      [&] { return at::matmul(xs, w.t()).sum(); }, nn::TensorList{w})();
  if (distributed) {
    ASSERT_TRUE(is_dtensor(loss));
    EXPECT_TRUE(layout_of(loss).placements()[0].is_partial()) << layout_of(loss).str();
  }
  at::Tensor ref_loss = at::matmul(x, w_full.t()).sum();
  EXPECT_TRUE(tensors_equal(whole(loss), ref_loss.detach()));
  expect_grads_equal(grads, torch::autograd::grad({ref_loss}, {w_full}));
}


// Data and tensor parallelism together, by plan alone: on a 2 x 2 (dp, tp)
// mesh the batch's rows split over dp and the MLP over tp. The mean loss is
// then a sum over dp of partial sums, and a per-row loss vector is
// Shard(0) over dp and Replicate over tp (repeat_num 2).
TEST(ValueAndGrad, DataAndTensorParallelMesh) {
  if (world_size() != 4) GTEST_SKIP() << "needs a 2 x 2 mesh";
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "tp"});
  ShardingPlan plan;
  plan.plan = {{"fc1.weight", {"tp", "None"}},
               {"fc1.bias", {"tp"}},
               {"fc2.weight", {"None", "tp"}},
               {"fc2.bias", {"None"}}};
  plan.input_plan = {{"input", {"dp", "None"}}};
  plan.output_plan = {{"output", {"dp", "None"}}};
  const Layout replicated(mesh, {Replicate(), Replicate()});
  const Layout rows(mesh, {Shard(0), Replicate()});
  {
    SCOPED_TRACE("mean loss, random floats");
    TpMlp model = make_tp_mlp(), ref = make_tp_mlp();
    shard_module(model, mesh, plan);
    torch::manual_seed(25);
    const at::Tensor x = torch::randn({5, 6}), y = torch::randn({5, 6});
    auto [loss, grads] = parallelize_value_and_grad(
        [&] {
          // A replicated DTensor input, which the input hook splits by rows.
          at::Tensor diff = model(distribute(x, replicated)) - y;
          return (diff * diff).mean();
        },
        model->parameters())();
    const test::MlpBounds bounds = test::mlp_bounds(ref, x, y);
    at::Tensor ref_diff = ref(x) - y;
    at::Tensor ref_loss = (ref_diff * ref_diff).mean();
    ref_loss.backward();
    EXPECT_TRUE(within_bound(whole(loss).item<double>(), ref_loss.item<double>(), bounds.loss));
    auto names = model->named_parameters().keys();
    auto ref_params = ref->named_parameters();
    for (size_t i = 0; i < names.size(); ++i) {
      SCOPED_TRACE(names[i]);
      ASSERT_TRUE(grads[i].defined());
      EXPECT_EQ(layout_of(grads[i]), layout_of(model->named_parameters()[names[i]]))
          << layout_of(grads[i]).str();
      EXPECT_TRUE(
          within_bound(whole(grads[i]), ref_params[names[i]].grad(), bounds.grad.at(names[i])));
    }
  }
  {
    SCOPED_TRACE("per-row loss, integers");
    TpMlp model = integer_mlp(), ref = integer_mlp();
    shard_module(model, mesh, plan);
    torch::manual_seed(26);
    const at::Tensor x = ints({5, 6}), y = ints({5, 6});
    auto [loss, grads] = parallelize_value_and_grad(
        [&] {
          at::Tensor diff = model(distribute(x, replicated)) - y;
          return (diff * diff).sum(1);
        },
        model->parameters())();
    EXPECT_EQ(layout_of(loss), rows);
    EXPECT_EQ(layout_of(loss).repeat_num(), 2);
    at::Tensor ref_diff = ref(x) - y;
    at::Tensor ref_loss = (ref_diff * ref_diff).sum(1);
    EXPECT_TRUE(tensors_equal(whole(loss), ref_loss.detach()));
    expect_grads_equal(grads, torch::autograd::grad({ref_loss}, ref->parameters(),
                                                    {torch::ones_like(ref_loss)}));
  }
}

}  // namespace
}  // namespace hp
