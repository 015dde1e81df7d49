// shard_module (S1-S3): a ReLU MLP made tensor parallel by plan (fc1
// column parallel, fc2 row parallel) against the same MLP in one process,
// on 1 to 4 ranks (3 and 4 split its hidden width unevenly): outputs,
// losses, every gradient and three AdamW steps, within the bounds
// tests/tp/tp_mlp.h derives. Also the alias form, nested keys,
// return_local_tensor, a plain function, the one-rank no-op and every
// validation error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/shard_module.h"
#include "hp/util/error.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"
#include "tests/tp/tp_mlp.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;
using test::make_tp_mlp;
using test::TpMlp;
using test::within_bound;

using test::world_size;

using test::tp_mesh;
using test::whole;

ShardingPlan mlp_plan() {
  ShardingPlan plan;
  plan.plan = {{"fc1.weight", {Shard(0)}},
               {"fc1.bias", {Shard(0)}},
               {"fc2.weight", {Shard(1)}},
               {"fc2.bias", {Replicate()}}};
  plan.input_plan = {{"input", {Replicate()}}};
  plan.output_plan = {{"output", {Replicate()}}};
  return plan;
}

at::Tensor mse(const at::Tensor& out, const at::Tensor& y) {
  at::Tensor diff = out - y;
  return (diff * diff).mean();
}

const test::AdamWHyper kAdam{1e-2, 0.9, 0.999, 1e-8, 1e-2};

torch::optim::AdamW make_adamw(const std::vector<at::Tensor>& params) {
  return torch::optim::AdamW(params, torch::optim::AdamWOptions(kAdam.lr)
                                         .betas({kAdam.beta1, kAdam.beta2})
                                         .eps(kAdam.eps)
                                         .weight_decay(kAdam.weight_decay));
}

// Sets each parameter of `model` to `ref`'s value (each rank its piece), so
// that the next step's comparison starts from equal parameters.
void copy_parameters(TpMlp& model, TpMlp& ref) {
  at::NoGradGuard no_grad;
  auto ref_params = ref->named_parameters();
  for (auto& item : model->named_parameters()) {
    const at::Tensor& value = ref_params[item.key()];
    if (is_dtensor(item.value())) {
      local_of(item.value()).copy_(local_of(distribute(value.detach(), layout_of(item.value()))));
    } else {
      item.value().copy_(value);
    }
  }
}

void expect_layout(const at::Tensor& t, const DeviceMeshPtr& mesh, const Placements& placements) {
  if (world_size() == 1) {
    EXPECT_FALSE(is_dtensor(t));
    return;
  }
  ASSERT_TRUE(is_dtensor(t));
  EXPECT_EQ(layout_of(t), Layout(mesh, placements)) << layout_of(t).str();
}

TEST(ShardModule, MlpTrainsLikeOneProcess) {
  auto mesh = tp_mesh();
  TpMlp model = make_tp_mlp(), ref = make_tp_mlp();
  shard_module(model, mesh, mlp_plan());
  expect_layout(model->fc1->weight, mesh, {Shard(0)});
  expect_layout(model->fc1->bias, mesh, {Shard(0)});
  expect_layout(model->fc2->weight, mesh, {Shard(1)});
  expect_layout(model->fc2->bias, mesh, {Replicate()});
  // The registry holds what the fields hold.
  EXPECT_TRUE(model->named_parameters()["fc1.weight"].is_same(model->fc1->weight));

  auto opt = make_adamw(model->parameters());
  auto ref_opt = make_adamw(ref->parameters());
  test::AdamWBound adam(kAdam);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(testing::Message() << "step " << step);
    torch::manual_seed(100 + step);
    const at::Tensor x = torch::randn({5, 6}), y = torch::randn({5, 6});
    const test::MlpBounds bounds = test::mlp_bounds(ref, x, y);
    at::Tensor ref_out = ref(x);
    at::Tensor ref_loss = mse(ref_out, y);
    ref_loss.backward();

    // Step 1 feeds the batch as a DTensor sharded by rows (5 rows: uneven
    // or empty pieces), which the input hook gathers; the others a plain
    // tensor, which passes the hook and counts as Replicate.
    const bool sharded_input = step == 1 && world_size() > 1;
    at::Tensor out = model(sharded_input ? distribute(x, Layout(mesh, {Shard(0)})) : x);
    expect_layout(out, mesh, {Replicate()});
    EXPECT_TRUE(within_bound(whole(out), ref_out, bounds.out)) << "output";
    at::Tensor loss = mse(out, y);
    loss.backward();
    EXPECT_TRUE(within_bound(whole(loss).item<double>(), ref_loss.item<double>(), bounds.loss))
        << "loss";

    auto ref_params = ref->named_parameters();
    for (auto& item : model->named_parameters()) {
      SCOPED_TRACE(item.key());
      const at::Tensor grad = item.value().grad();
      ASSERT_TRUE(grad.defined());
      if (world_size() > 1) {
        ASSERT_TRUE(is_dtensor(grad));
        EXPECT_EQ(layout_of(grad), layout_of(item.value())) << layout_of(grad).str();
      }
      EXPECT_TRUE(within_bound(whole(grad), ref_params[item.key()].grad(),
                               bounds.grad.at(item.key())))
          << "gradient";
    }

    std::map<std::string, at::Tensor> param_bounds;
    for (auto& item : ref->named_parameters()) {
      param_bounds[item.key()] = adam.step(item.key(), item.value().detach(), item.value().grad(),
                                           bounds.grad.at(item.key()));
    }
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
    for (auto& item : model->named_parameters()) {
      EXPECT_TRUE(within_bound(whole(item.value()), ref_params[item.key()].detach(),
                               param_bounds.at(item.key())))
          << item.key() << " after the AdamW step";
    }
    copy_parameters(model, ref);
  }
}

// An hp::nn::Module around the MLP: plan keys with module prefixes.
struct WrapperImpl : nn::Module {
  WrapperImpl() : nn::Module("Wrapper") { mlp = register_module("mlp", make_tp_mlp()); }
  at::Tensor forward(const at::Tensor& x) { return mlp(x); }
  TpMlp mlp{nullptr};
};
HP_MODULE(Wrapper);

TEST(ShardModule, AliasFormAndNestedKeys) {
  auto mesh = tp_mesh();
  Wrapper model;
  TpMlp ref = make_tp_mlp();
  ShardingPlan plan;
  plan.plan = {{"mlp.fc1.weight", {"tp", "None"}},
               {"mlp.fc1.bias", {"tp"}},
               {"mlp.fc2.weight", {"None", "tp"}},
               {"mlp.fc2.bias", {"None"}}};
  plan.input_plan = {{"mlp.input", {"None", "None"}}};
  plan.output_plan = {{"mlp.output", {{"tp"}, "None"}}};  // a tuple of one mesh dim
  shard_module(model, mesh, plan);
  expect_layout(model->mlp->fc1->weight, mesh, {Shard(0)});
  expect_layout(model->mlp->fc1->bias, mesh, {Shard(0)});
  expect_layout(model->mlp->fc2->weight, mesh, {Shard(1)});
  expect_layout(model->mlp->fc2->bias, mesh, {Replicate()});

  torch::manual_seed(3);
  const at::Tensor x = torch::randn({5, 6});
  at::Tensor out = model(x);
  expect_layout(out, mesh, {Shard(0)});
  EXPECT_TRUE(within_bound(whole(out), ref(x), test::mlp_bounds(ref, x, x).out));
}

TEST(ShardModule, ReturnLocalTensor) {
  auto mesh = tp_mesh();
  TpMlp ref = make_tp_mlp();
  torch::manual_seed(4);
  const at::Tensor x = torch::randn({5, 6});
  const at::Tensor expected = ref(x).detach();
  const at::Tensor bound = test::mlp_bounds(ref, x, x).out;
  auto piece = [&](const at::Tensor& t) {  // this rank's Shard(1) piece
    return world_size() == 1 ? t : local_of(distribute(t, Layout(mesh, {Shard(1)}))).clone();
  };

  // The module itself: its output laid out as Shard(1), then made local.
  TpMlp model = make_tp_mlp();
  ShardingPlan plan = mlp_plan();
  plan.output_plan = {{"output", {Shard(1)}}};
  plan.return_local_tensor = {""};
  shard_module(model, mesh, plan);
  at::Tensor out = model(x);
  EXPECT_FALSE(is_dtensor(out));
  EXPECT_TRUE(within_bound(out, piece(expected), piece(bound)));

  // A submodule: the wrapper receives a local (here whole) tensor.
  Wrapper wrapper;
  ShardingPlan nested;
  for (const auto& [name, layout] : mlp_plan().plan) nested.plan.emplace("mlp." + name, layout);
  nested.output_plan = {{"mlp.output", {Replicate()}}};
  nested.return_local_tensor = {"mlp"};
  shard_module(wrapper, mesh, nested);
  out = wrapper(x);
  EXPECT_FALSE(is_dtensor(out));
  EXPECT_TRUE(within_bound(out, expected, bound));
}

TEST(ShardModule, OneRankMeshChangesNothing) {
  // A size-1 mesh dim of a [world, 1] mesh: this rank alone.
  auto mesh = init_device_mesh("cpu", {world_size(), 1}, {"dp", "tp"})->sub({"tp"});
  ASSERT_EQ(mesh->size(), 1);
  TpMlp model = make_tp_mlp();
  const at::Tensor weight = model->fc1->weight;
  ShardingPlan plan = mlp_plan();
  plan.return_local_tensor = {""};
  EXPECT_EQ(shard_module(model, mesh, plan), model.ptr());
  EXPECT_TRUE(model->fc1->weight.is_same(weight));
  EXPECT_FALSE(model->has_forward_hooks());
  // The plan is still checked.
  plan.plan["fc3.weight"] = {Shard(0)};
  EXPECT_THAT([&] { shard_module(model, mesh, plan); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("fc3.weight is configured with a layout, but no instance was found.")));
}

// Two inputs, two outputs, with declared argument names.
struct PairImpl : nn::Module {
  PairImpl() : nn::Module("Pair") { set_forward_arg_names(*this, {"a", "b"}); }
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& a, const at::Tensor& b) {
    return {a * 2, a + b};
  }
};
HP_MODULE(Pair);

TEST(ShardModule, InputsByPositionAndName) {
  if (world_size() == 1) GTEST_SKIP() << "hooks are installed on more than one rank";
  auto mesh = tp_mesh();
  torch::manual_seed(5);
  const at::Tensor a = torch::randn({4, 3}), b = torch::randn({4, 3});
  const Layout replicate(mesh, {Replicate()});
  for (bool by_name : {false, true}) {
    SCOPED_TRACE(by_name ? "by name" : "by position");
    Pair pair;
    ShardingPlan plan;
    plan.input_plan = {{"input", by_name ? ForwardLayouts::by_name({{"b", {Shard(1)}}})
                                         : ForwardLayouts::positional({std::nullopt, PlanLayout{Shard(1)}})}};
    plan.output_plan = {{"output", ForwardLayouts::positional({PlanLayout{Shard(0)}, std::nullopt})}};
    shard_module(pair, mesh, plan);
    // a stays Replicate, b becomes Shard(1); a plain tensor passes.
    auto [doubled, sum] = pair(distribute(a, replicate), distribute(b, replicate));
    expect_layout(doubled, mesh, {Shard(0)});
    EXPECT_TRUE(test::tensors_equal(whole(doubled), a * 2));
    EXPECT_TRUE(test::tensors_equal(whole(sum), a + b));
    auto [d2, s2] = pair(a, b);
    EXPECT_FALSE(is_dtensor(s2));
  }
}

TEST(ShardModule, ErrorsInTheCall) {
  if (world_size() == 1) GTEST_SKIP() << "hooks are installed on more than one rank";
  auto mesh = tp_mesh();
  const Layout replicate(mesh, {Replicate()});
  const at::Tensor a = distribute(torch::ones({4, 3}), replicate);
  {
    Pair pair;
    ShardingPlan plan;
    plan.output_plan = {{"output", {Replicate()}}};
    shard_module(pair, mesh, plan);
    EXPECT_THAT([&] { pair(a, a); },
                ThrowsMessage<ArgumentError>(AllOf(
                    HasSubstr("output_plan['output']"),
                    HasSubstr("the number of outputs and of planned layouts must be equal, but "
                              "got 2 outputs and 1 layouts"))));
  }
  {
    Pair pair;
    ShardingPlan plan;
    plan.input_plan = {{"input", {Replicate()}}};
    shard_module(pair, mesh, plan);
    EXPECT_THAT([&] { pair(a, a); },
                ThrowsMessage<ArgumentError>(AllOf(HasSubstr("input_plan['input']: input 1 is a "
                                                             "DTensor but the plan gives layouts "
                                                             "for 1 positions"))));
    pair(a, torch::ones({4, 3}));  // a plain second input passes
  }
  {
    Pair pair;
    ShardingPlan plan;
    plan.input_plan = {{"input", {"tp"}}};  // one entry, the input has two dims
    shard_module(pair, mesh, plan);
    EXPECT_THAT([&] { pair(a, a); },
                ThrowsMessage<ArgumentError>(HasSubstr(
                    "input_plan['input'][0]: the alias layout has 1 entries but the input has 2 dims")));
  }
}

TEST(ShardModule, ValidationErrorsChangeNothing) {
  auto mesh = tp_mesh();
  TpMlp model = make_tp_mlp();
  const at::Tensor weight = model->fc1->weight;
  auto expect_error = [&](const ShardingPlan& plan, const std::string& message) {
    SCOPED_TRACE(message);
    EXPECT_THAT([&] { shard_module(model, mesh, plan); },
                ThrowsMessage<ArgumentError>(HasSubstr(message)));
    EXPECT_TRUE(model->fc1->weight.is_same(weight));
    EXPECT_FALSE(model->has_forward_hooks());
  };
  ShardingPlan plan = mlp_plan();
  plan.plan["fc3.weight"] = {Shard(0)};
  expect_error(plan, "plan['fc3.weight']: fc3.weight is configured with a layout, but no "
                     "instance was found.");

  plan = mlp_plan();
  plan.plan["fc1.weight"] = {Shard(0), Replicate()};
  expect_error(plan, "plan['fc1.weight']: layout [S(0), R] has 2 placements but the mesh has 1 "
                     "dims ['tp']");
  plan.plan["fc1.weight"] = {Shard(2)};
  expect_error(plan, "plan['fc1.weight']");
  plan.plan["fc1.weight"] = {"tp"};
  expect_error(plan, "plan['fc1.weight']: layout ('tp') has 1 entries but the tensor has 2 dims");
  plan.plan["fc1.weight"] = {"dp", "None"};
  expect_error(plan, "plan['fc1.weight']");

  plan = mlp_plan();
  plan.input_plan["fc2.inputs"] = {Replicate()};
  expect_error(plan, "input_plan['fc2.inputs']: input_plan keys must end with 'input'");
  plan = mlp_plan();
  plan.input_plan["output"] = {Replicate()};
  expect_error(plan, "input_plan keys must end with 'input' ('<module>.input', or 'input' for "
                     "the module itself), but got 'output'");
  plan = mlp_plan();
  plan.output_plan["fc3.output"] = {Replicate()};
  expect_error(plan, "output_plan['fc3.output']: fc3 is configured with a layout, but no "
                     "instance was found.");
  plan = mlp_plan();
  plan.output_plan["fc2.output"] = {Replicate()};
  expect_error(plan, "module 'fc2' is a torch::nn::LinearImpl, which has no forward hooks");
  plan = mlp_plan();
  plan.return_local_tensor = {"fc3"};
  expect_error(plan, "return_local_tensor 'fc3': fc3 is configured with a layout");
  plan = mlp_plan();
  plan.input_plan["input"] = ForwardLayouts::by_name({{"x", {Replicate()}}});
  expect_error(plan, "layouts by argument name need the forward's argument names");
  plan = mlp_plan();
  plan.output_plan["output"] = ForwardLayouts::by_name({{"y", {Replicate()}}});
  expect_error(plan, "outputs have no names");

  Pair pair;
  plan = {};
  plan.input_plan["input"] = ForwardLayouts::by_name({{"c", {Replicate()}}});
  EXPECT_THAT([&] { shard_module(pair, mesh, plan); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("argument 'c' is configured with a layout, but the forward's "
                            "arguments are ['a', 'b']")));
}

TEST(ShardModule, TiedParametersTakeOneLayout) {
  auto mesh = tp_mesh();
  TpMlp model = make_tp_mlp();
  // fc1.weight registered again under another name, as a tied head would be.
  auto tied = std::make_shared<torch::nn::Module>();
  tied->register_parameter("weight", model->fc1->weight);
  model->register_module("tied", tied);
  ShardingPlan plan = mlp_plan();
  plan.plan["tied.weight"] = {Shard(1)};
  EXPECT_THAT([&] { shard_module(model, mesh, plan); },
              ThrowsMessage<ArgumentError>(HasSubstr("tied parameters take one layout")));
  plan.plan["tied.weight"] = {Shard(0)};
  shard_module(model, mesh, plan);
  EXPECT_TRUE(model->named_parameters()["tied.weight"].is_same(model->fc1->weight));
  expect_layout(model->fc1->weight, mesh, {Shard(0)});
}

TEST(ShardModule, PlainFunction) {
  auto mesh = tp_mesh();
  torch::manual_seed(6);
  const at::Tensor a = torch::randn({5, 4}), b = torch::randn({4, 3});
  TensorFunction matmul = [](const nn::TensorList& args) {
    return nn::TensorList{at::matmul(args.at(0), args.at(1))};
  };
  ShardingPlan plan;
  // Rows of a split over the ranks, b whole: each rank multiplies its rows.
  plan.input_plan = {{"input", ForwardLayouts::positional({PlanLayout{Shard(0)}, PlanLayout{Replicate()}})}};
  plan.output_plan = {{"output", {Replicate()}}};
  TensorFunction sharded = shard_module(matmul, mesh, plan);
  const Layout replicate(mesh, {Replicate()});
  const bool distributed = world_size() > 1;
  nn::TensorList out = sharded({distributed ? distribute(a, replicate) : a,
                                distributed ? distribute(b, replicate) : b});
  ASSERT_EQ(out.size(), 1u);
  expect_layout(out[0], mesh, {Replicate()});
  // Each element is the same 4-term dot product, which a BLAS may order
  // differently for fewer rows.
  const at::Tensor bound = test::reordered_sum_bound(
      a.abs().to(at::kDouble).mm(b.abs().to(at::kDouble)), 4, at::kFloat);
  EXPECT_TRUE(within_bound(whole(out[0]), at::matmul(a, b), bound));

  // By name.
  plan.input_plan = {{"input", ForwardLayouts::by_name({{"a", {Shard(0)}}})}};
  sharded = shard_module(matmul, mesh, plan, {"a", "b"});
  out = sharded({distributed ? distribute(a, replicate) : a, b});
  EXPECT_TRUE(within_bound(whole(out[0]), at::matmul(a, b), bound));

  ShardingPlan bad;
  bad.plan["w"] = {Shard(0)};
  EXPECT_THAT([&] { shard_module(matmul, mesh, bad); },
              ThrowsMessage<ArgumentError>(HasSubstr("a function has no parameters")));
  bad = {};
  bad.input_plan["f.input"] = {Shard(0)};
  EXPECT_THAT([&] { shard_module(matmul, mesh, bad); },
              ThrowsMessage<ArgumentError>(HasSubstr("a function's input_plan has the one key 'input'")));
  bad = {};
  bad.return_local_tensor = {"f"};
  EXPECT_THAT([&] { shard_module(matmul, mesh, bad); },
              ThrowsMessage<ArgumentError>(HasSubstr("a function has no submodules")));
}

}  // namespace
}  // namespace hp
