// parallelize_value_and_grad over fully_shard units (S5 with F4): the
// gradients it returns are the reduced shards .grad would hold after
// backward(), in the parameters' own shapes, equal to one process's
// gradients of the global batch, and every .grad (and main grad) is left as
// it was, also when the backward raises. A bare torch::autograd::grad over
// managed parameters, which would return each rank's unreduced gradient,
// raises before any collective of its backward and leaves the units usable;
// one over the inputs alone still works.
//
// Tolerances as in parity_test.cpp (tests/fsdp/data_parallel_reference.h):
// the reference runs the ranks' slices of the global batch one after the
// other and averages their gradients; each rank computes its slice's
// gradient as the reference does, and the run differs only in the order
// the collectives add the slices, so each gradient is held to the
// reordering bound of the terms the reference recorded.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/tp/value_and_grad.h"
#include "hp/util/error.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

struct GradCase {
  std::string name;
  std::vector<int64_t> mesh_shape;  // {w}: FSDP; {r, s}: HSDP (DDP when s = 1)
  bool comm_fusion = false;
  bool main_grad = false;         // MixedPrecisionPolicy::apply_grad_on_fp32_main_grad
  bool is_last_backward = true;   // false: the reductions are left in flight
};

std::vector<GradCase> grad_cases() {
  const int64_t w = dist::get_world_size();
  std::vector<GradCase> out{{"fsdp", {w}},
                            {"fsdp comm_fusion", {w}, true},
                            {"fsdp main grad", {w}, false, true},
                            {"fsdp not last backward", {w}, false, false, false},
                            {"ddp", {w, 1}}};
  if (w == 4) {
    out.push_back({"hsdp", {2, 2}});
    out.push_back({"hsdp comm_fusion", {2, 2}, true});
  }
  return out;
}

struct Sharded {
  test::ToyModel model;
  FSDPModule root;
};

Sharded shard(const GradCase& config) {
  auto model = test::make_toy_model();
  FullyShardOptions options;
  options.mesh = test::data_parallel_mesh(config.mesh_shape);
  options.comm_fusion = config.comm_fusion;
  options.mp_policy.apply_grad_on_fp32_main_grad = config.main_grad;
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  return {model, root};
}

at::Tensor mse_of(test::ToyModel& model, const at::Tensor& x, const at::Tensor& y) {
  return torch::mse_loss(model(x), y);
}

// What every parameter of `model` holds: .grad and (main grad units) the
// main grad, as they are (the same tensors) and as values (copies).
struct Held {
  std::map<std::string, at::Tensor> grad, grad_copy, main, main_copy;
};

Held held_by(test::ToyModel& model, bool main_grad) {
  Held h;
  for (auto& item : model->named_parameters()) {
    const at::Tensor& g = item.value().grad();
    h.grad[item.key()] = g;
    h.grad_copy[item.key()] = g.defined() ? g.clone() : g;
    if (!main_grad) continue;
    at::Tensor m = hp::main_grad(item.value());
    h.main[item.key()] = m;
    h.main_copy[item.key()] = m.defined() ? m.clone() : m;
  }
  return h;
}

// `model` holds the very tensors `before` recorded, with the same values.
void expect_held_unchanged(test::ToyModel& model, const Held& before, bool main_grad) {
  const Held now = held_by(model, main_grad);
  for (auto& [name, g] : before.grad) {
    SCOPED_TRACE(name);
    ASSERT_EQ(now.grad.at(name).defined(), g.defined());
    if (!g.defined()) continue;
    EXPECT_TRUE(now.grad.at(name).is_same(g));
    EXPECT_TRUE(test::tensors_equal(now.grad.at(name), before.grad_copy.at(name)));
  }
  for (auto& [name, m] : before.main) {
    SCOPED_TRACE(name + " main grad");
    ASSERT_TRUE(m.defined() && now.main.at(name).defined());
    EXPECT_TRUE(now.main.at(name).is_same(m));
    EXPECT_TRUE(test::tensors_equal(now.main.at(name), before.main_copy.at(name)));
  }
}

// An earlier backward on another batch: gradients accumulated before the
// call under test, which it must neither read nor change.
void accumulate_earlier_gradients(test::ToyModel& model) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  auto [x, y] = test::global_batch(7);
  mse_of(model, test::rows_for(x, rank, world), test::rows_for(y, rank, world)).backward();
}

// parallelize_value_and_grad of the MSE of global batch 0 on this rank's
// rows: the loss and each gradient against the reference's of the whole
// batch. Each gradient is the reduced shard: the parameter's own (shard)
// shape, the matching shard of the reference's gradient.
void expect_value_and_grad_matches(test::ToyModel& model, FSDPModule& root,
                                   bool is_last_backward) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  auto reference = test::make_toy_model();
  auto [x, y] = test::global_batch(0);
  at::Tensor ref_loss = test::data_parallel_backward(
      reference->parameters(), reference->parameters(), world, [&](int64_t part) {
        return mse_of(reference, test::rows_for(x, part, world), test::rows_for(y, part, world));
      });
  if (!is_last_backward) root.set_is_last_backward(false);
  auto step = parallelize_value_and_grad(
      [&](const at::Tensor& input, const at::Tensor& target) {
        return mse_of(model, input, target);
      },
      model->parameters());
  auto [loss, grads] = step(test::rows_for(x, rank, world), test::rows_for(y, rank, world));
  root.set_is_last_backward(true);

  EXPECT_TRUE(test::within_bound(test::world_mean(loss.item<double>()), ref_loss.item<double>(),
                                 test::loss_bound(ref_loss, world)))
      << "loss";
  auto params = model->named_parameters();
  ASSERT_EQ(grads.size(), params.size());
  std::map<std::string, at::Tensor> by_name;
  for (size_t i = 0; i < grads.size(); ++i) {
    ASSERT_TRUE(grads[i].defined()) << params[i].key();
    EXPECT_EQ(grads[i].sizes(), params[i].value().sizes()) << params[i].key();
    by_name[params[i].key()] = grads[i];
  }
  test::expect_gradient_shards_within(model, reference, by_name,
                                      test::gradient_bounds(reference));
}

TEST(FsdpValueAndGrad, ReturnsReducedShardsLikeOneProcess) {
  for (const GradCase& config : grad_cases()) {
    SCOPED_TRACE(config.name);
    auto [model, root] = shard(config);
    accumulate_earlier_gradients(model);
    const Held before = held_by(model, config.main_grad);
    expect_value_and_grad_matches(model, root, config.is_last_backward);
    expect_held_unchanged(model, before, config.main_grad);
  }
}

// A backward that raises inside the call: the weights hold what they held
// before (the units drop what the backward had started, root_context.h),
// and the units are usable: the next call gives the reduced shards.
TEST(FsdpValueAndGrad, RaisingBackwardKeepsGradients) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  for (const GradCase& config : grad_cases()) {
    SCOPED_TRACE(config.name);
    auto [model, root] = shard(config);
    accumulate_earlier_gradients(model);
    const Held before = held_by(model, config.main_grad);
    // Raised while the later blocks' gradients are being reduced and block
    // 1's backward has not started.
    bool fail = true;
    model->block_list[1]->register_forward_hook(
        [&fail](nn::Module&, const nn::TensorList&,
                const nn::TensorList& outputs) -> std::optional<nn::TensorList> {
          if (fail) {
            outputs[0].register_hook([](const at::Tensor&) -> at::Tensor {
              throw std::runtime_error("hook failed in backward");
            });
          }
          return std::nullopt;
        });
    auto [x, y] = test::global_batch(0);
    auto step = parallelize_value_and_grad(
        [&] {
          return mse_of(model, test::rows_for(x, rank, world), test::rows_for(y, rank, world));
        },
        model->parameters());
    EXPECT_THAT([&] { step(); },
                ThrowsMessage<std::exception>(HasSubstr("hook failed in backward")));
    expect_held_unchanged(model, before, config.main_grad);
    fail = false;
    expect_value_and_grad_matches(model, root, config.is_last_backward);
    expect_held_unchanged(model, before, config.main_grad);
  }
}

TEST(FsdpValueAndGrad, BareAutogradGradRaisesBeforeAnyCollective) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  for (const GradCase& config : grad_cases()) {
    SCOPED_TRACE(config.name);
    auto reference = test::make_toy_model();
    auto [model, root] = shard(config);
    accumulate_earlier_gradients(model);
    const Held before = held_by(model, config.main_grad);
    auto [x, y] = test::global_batch(0);
    const at::Tensor x_mine = test::rows_for(x, rank, world);
    const at::Tensor y_mine = test::rows_for(y, rank, world);

    // The gradient of the input alone runs no gradient accumulator, so
    // nothing is reduced and nothing accumulates.
    {
      const at::Tensor input = x_mine.clone().requires_grad_();
      at::Tensor loss = mse_of(model, input, y_mine);
      const dist::CommStats stats = dist::comm_stats();
      nn::TensorList dx = torch::autograd::grad({loss}, {input});
      ASSERT_TRUE(dx[0].defined());
      EXPECT_EQ(dx[0].sizes(), input.sizes());
      EXPECT_EQ(dist::comm_stats()[dist::OpType::kReduceScatter],
                stats[dist::OpType::kReduceScatter]);
      EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllReduce], stats[dist::OpType::kAllReduce]);
      expect_held_unchanged(model, before, config.main_grad);
    }

    // The parameters' gradients: refused at the first unit's pre-backward,
    // before it gathers or reduces anything.
    {
      at::Tensor loss = mse_of(model, x_mine, y_mine);
      const dist::CommStats stats = dist::comm_stats();
      EXPECT_THAT([&] { torch::autograd::grad({loss}, model->parameters()); },
                  ThrowsMessage<ArgumentError>(AllOf(
                      HasSubstr("torch::autograd::grad was asked for the gradients of parameters "
                                "that fully_shard units manage"),
                      HasSubstr("ToyModel: head.weight"), HasSubstr("unreduced gradient"),
                      HasSubstr("hp::parallelize_value_and_grad"), HasSubstr("backward()"))));
      EXPECT_EQ(dist::comm_stats().total(), stats.total());
      expect_held_unchanged(model, before, config.main_grad);
    }

    // The units are usable: the next backward reduces as usual.
    root.zero_grad();
    test::data_parallel_backward(reference->parameters(), reference->parameters(), world,
                                 [&](int64_t part) {
                                   return mse_of(reference, test::rows_for(x, part, world),
                                                 test::rows_for(y, part, world));
                                 });
    mse_of(model, x_mine, y_mine).backward();
    std::map<std::string, at::Tensor> grads;
    for (auto& item : model->named_parameters()) {
      grads[item.key()] = config.main_grad ? hp::main_grad(item.value()) : item.value().grad();
    }
    test::expect_gradient_shards_within(model, reference, grads, test::gradient_bounds(reference));
  }
}

// Units that do not reduce fully in a backward cannot give reduced
// gradients: refused before fn runs; the same call works once they do.
TEST(FsdpValueAndGrad, RefusesUnitsThatDoNotReduceFully) {
  const int64_t world = dist::get_world_size();
  std::vector<std::pair<GradCase, std::function<void(FSDPModule&, bool)>>> cases{
      {{"fsdp", {world}}, [](FSDPModule& root, bool on) { root.set_requires_gradient_sync(on); }}};
  if (world == 4) {
    cases.push_back({{"hsdp", {2, 2}},
                     [](FSDPModule& root, bool on) { root.set_requires_all_reduce(on); }});
  }
  for (auto& [config, set] : cases) {
    SCOPED_TRACE(config.name);
    auto [model, root] = shard(config);
    int calls = 0;
    auto step = parallelize_value_and_grad(
        [&] {
          ++calls;
          auto [x, y] = test::global_batch(0);
          return mse_of(model, x, y);
        },
        model->parameters());
    set(root, false);
    EXPECT_THAT([&] { step(); },
                ThrowsMessage<ArgumentError>(AllOf(
                    HasSubstr("parallelize_value_and_grad: unit ToyModel"),
                    HasSubstr(config.mesh_shape.size() == 1 ? "set_requires_gradient_sync(false)"
                                                            : "set_requires_all_reduce(false)"))));
    EXPECT_EQ(calls, 0);
    set(root, true);
    auto [loss, grads] = step();
    EXPECT_EQ(calls, 1);
    for (const at::Tensor& g : grads) EXPECT_TRUE(g.defined());
  }
}

}  // namespace
}  // namespace hp
