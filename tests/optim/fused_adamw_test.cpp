// FusedAdamW against torch::optim::AdamW: the same options and state give
// the same step up to rounding (or bit for bit where it falls back to
// AdamW's own step), and the state it keeps is AdamW's.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/optim/fused_adamw.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tensor/placement.h"
#include "hp/util/torch_compat.h"
#include "tests/support/adamw_step_bounds.h"
#include "tests/support/rounding_bounds.h"

namespace hp {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kDecay = 0.1;

AdamWOptions options(bool amsgrad = false) {
  return AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kDecay).amsgrad(amsgrad);
}

// Shapes with and without a multiple of a vector width of elements.
std::vector<at::Tensor> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> params;
  for (auto shape : std::vector<std::vector<int64_t>>{{37, 16}, {129}, {3, 5, 7}}) {
    params.push_back(torch::randn(shape).requires_grad_());
  }
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, uint64_t seed) {
  torch::manual_seed(seed);
  for (const auto& p : params) p.mutable_grad() = torch::randn_like(p);
}

AdamWParamState& state_of(torch::optim::Optimizer& optimizer, const at::Tensor& p) {
  return static_cast<AdamWParamState&>(*optimizer.state().at(compat::optimizer_state_key(p)));
}

// The bound on one step's m', v' and p' (tests/support/adamw_step_bounds.h).
using StepBounds = test::AdamWStepBounds;

StepBounds step_bounds(const at::Tensor& p0, const at::Tensor& m0, const at::Tensor& v0,
                       const at::Tensor& g0, int64_t step) {
  test::AdamWHyper hyper;
  hyper.lr = kLr;
  hyper.beta1 = kBeta1;
  hyper.beta2 = kBeta2;
  hyper.eps = kEps;
  hyper.weight_decay = kDecay;
  return test::adamw_step_bounds(hyper, p0, m0, v0, g0, step);
}

TEST(FusedAdamW, StepsLikeAdamWUpToRounding) {
  auto reference_params = make_params(1);
  auto fused_params = make_params(1);
  torch::optim::AdamW reference(reference_params, options());
  optim::FusedAdamW fused(fused_params, options());
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(reference_params, 100 + step);
    set_grads(fused_params, 100 + step);
    // Both start this step from the reference's state (the first from
    // none), so each step is compared alone: no differences compound.
    std::vector<at::Tensor> p0, m0, v0;
    for (size_t i = 0; i < reference_params.size(); ++i) {
      const at::Tensor& p = reference_params[i];
      p0.push_back(p.detach().clone());
      const bool has = step > 1;
      m0.push_back(has ? state_of(reference, p).exp_avg().clone() : torch::zeros_like(p));
      v0.push_back(has ? state_of(reference, p).exp_avg_sq().clone() : torch::zeros_like(p));
      if (has) {
        torch::NoGradGuard no_grad;
        fused_params[i].copy_(p);
        state_of(fused, fused_params[i]).exp_avg().copy_(m0[i]);
        state_of(fused, fused_params[i]).exp_avg_sq().copy_(v0[i]);
      }
    }
    reference.step();
    fused.step();
    EXPECT_EQ(fused.last_step_fused(), optim::FusedAdamW::available());
    for (size_t i = 0; i < reference_params.size(); ++i) {
      SCOPED_TRACE("parameter " + std::to_string(i));
      const at::Tensor& r = reference_params[i];
      const at::Tensor& f = fused_params[i];
      const AdamWParamState& rs = state_of(reference, r);
      const AdamWParamState& fs = state_of(fused, f);
      EXPECT_EQ(fs.step(), step);
      if (!optim::FusedAdamW::available()) {  // AdamW's own step: the same bits
        EXPECT_TRUE(torch::equal(f, r));
        continue;
      }
      const StepBounds b = step_bounds(p0[i], m0[i], v0[i], r.grad(), step);
      EXPECT_TRUE(test::within_bound(fs.exp_avg(), rs.exp_avg(), b.m));
      EXPECT_TRUE(test::within_bound(fs.exp_avg_sq(), rs.exp_avg_sq(), b.v));
      EXPECT_TRUE(test::within_bound(f.detach(), r.detach(), b.p));
      // And it moved: a step that did nothing would be within the bound of
      // nothing.
      EXPECT_FALSE(torch::equal(f.detach(), p0[i]));
    }
  }
}

TEST(FusedAdamW, FallsBackToAdamWsStepWhereTheKernelDoesNotApply) {
  // amsgrad: the fused step has no max_exp_avg_sq of AdamW's; a double
  // parameter beside float ones: the kernel takes one dtype per call.
  for (bool amsgrad : {true, false}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "mixed dtypes");
    auto reference_params = make_params(2);
    auto fused_params = make_params(2);
    if (!amsgrad) {
      reference_params.push_back(torch::randn({9}, at::kDouble).requires_grad_());
      fused_params.push_back(reference_params.back().detach().clone().requires_grad_());
    }
    torch::optim::AdamW reference(reference_params, options(amsgrad));
    optim::FusedAdamW fused(fused_params, options(amsgrad));
    for (int64_t step = 1; step <= 2; ++step) {
      set_grads(reference_params, 200 + step);
      set_grads(fused_params, 200 + step);
      reference.step();
      fused.step();
      EXPECT_FALSE(fused.last_step_fused());
      for (size_t i = 0; i < reference_params.size(); ++i) {
        EXPECT_TRUE(torch::equal(fused_params[i], reference_params[i])) << "parameter " << i;
      }
    }
  }
}

TEST(FusedAdamW, SkipsParametersWithoutGradientsAndRunsTheClosure) {
  auto params = make_params(3);
  optim::FusedAdamW fused(params, options());
  set_grads(params, 300);
  params[1].mutable_grad() = at::Tensor();
  const at::Tensor before = params[1].detach().clone();
  int calls = 0;
  at::Tensor loss = fused.step([&] {
    ++calls;
    return torch::ones({});
  });
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(loss.defined());
  EXPECT_EQ(loss.item<float>(), 1.0f);
  EXPECT_TRUE(torch::equal(params[1], before));
  EXPECT_EQ(fused.state().count(compat::optimizer_state_key(params[1])), 0u);
  EXPECT_EQ(state_of(fused, params[0]).step(), 1);
}

// Tensor-form DTensor parameters (as tensor parallelism makes them): the
// fused step runs on the local shards when gradient and moments are laid
// out as the parameter, and gives what AdamW's step through the DTensor
// rules gives, up to rounding; a gradient laid out otherwise takes AdamW's
// own step. Shard(0) of 37 rows is uneven on 2 and 3 ranks.
TEST(FusedAdamW, StepsDTensorParametersOnTheirLocalShards) {
  if (!dist::is_initialized()) GTEST_SKIP() << "needs a launcher (ctest: optim.n2, optim.n3)";
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"x"});
  const Layout sharded(mesh, {Shard(0)}), replicated(mesh, {Replicate()});
  for (bool same_layout : {true, false}) {
    SCOPED_TRACE(same_layout ? "gradients laid out as the parameters" : "Shard(1) gradient");
    torch::manual_seed(4);
    const at::Tensor full_w = torch::randn({37, 16}), full_b = torch::randn({16});
    const at::Tensor grad_w = torch::randn({37, 16}), grad_b = torch::randn({16});
    auto make = [&] {
      std::vector<at::Tensor> params{distribute(full_w, sharded).requires_grad_(),
                                     distribute(full_b, replicated).requires_grad_()};
      params[0].mutable_grad() =
          distribute(grad_w, same_layout ? sharded : Layout(mesh, {Shard(1)}));
      params[1].mutable_grad() = distribute(grad_b, replicated);
      return params;
    };
    auto reference_params = make();
    auto fused_params = make();
    torch::optim::AdamW reference(reference_params, options());
    optim::FusedAdamW fused(fused_params, options());
    reference.step();
    fused.step();
    EXPECT_EQ(fused.last_step_fused(), same_layout && optim::FusedAdamW::available());
    for (size_t i = 0; i < 2; ++i) {
      SCOPED_TRACE("parameter " + std::to_string(i));
      ASSERT_TRUE(is_dtensor(fused_params[i]));
      EXPECT_EQ(layout_of(fused_params[i]), layout_of(reference_params[i]));
      const at::Tensor f = local_of(fused_params[i]), r = local_of(reference_params[i]);
      if (!fused.last_step_fused()) {
        EXPECT_TRUE(torch::equal(f, r));
        continue;
      }
      const at::Tensor p0 = local_of(make()[i]);
      const at::Tensor g = local_of(reference_params[i].grad());
      const StepBounds b = step_bounds(p0, torch::zeros_like(p0), torch::zeros_like(p0), g, 1);
      EXPECT_TRUE(test::within_bound(f, r, b.p));
      EXPECT_FALSE(torch::equal(f, p0));
    }
  }
}

}  // namespace
}  // namespace hp
