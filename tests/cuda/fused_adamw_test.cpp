// FusedAdamW on a GPU (libtorch's fused CUDA kernel) against
// torch::optim::AdamW's element-wise step on the same GPU, same data: equal
// up to rounding, each step compared from the same state, with the bound
// tests/optim/fused_adamw_test.cpp derives for the CPU kernel (one AdamW
// step in fp32 evaluated in two orders; counted per rounding, so a kernel
// that fuses a multiply-add into one rounding stays within it).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <vector>

#include "hp/optim/fused_adamw.h"
#include "hp/util/torch_compat.h"
#include "tests/cuda/on_cuda.h"
#include "tests/support/adamw_step_bounds.h"
#include "tests/support/rounding_bounds.h"

namespace hp::cuda_test {
namespace {

using torch::optim::AdamWOptions;
using torch::optim::AdamWParamState;

constexpr double kLr = 1e-2, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kDecay = 0.1;

AdamWOptions options() {
  return AdamWOptions(kLr).betas({kBeta1, kBeta2}).eps(kEps).weight_decay(kDecay);
}

// Shapes with and without a multiple of a vector width of elements.
std::vector<at::Tensor> make_params(c10::Device device) {
  at::Generator gen = at::detail::createCPUGenerator(1);
  std::vector<at::Tensor> params;
  for (auto shape : std::vector<std::vector<int64_t>>{{37, 16}, {129}, {3, 5, 7}}) {
    params.push_back(at::randn(shape, gen).to(device).requires_grad_());
  }
  return params;
}

void set_grads(const std::vector<at::Tensor>& params, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  for (const auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen).to(p.device());
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

TEST_F(OnCuda, FusedAdamWStepsLikeAdamWUpToRounding) {
  auto reference_params = make_params(device_);
  auto fused_params = make_params(device_);
  torch::optim::AdamW reference(reference_params, options());
  optim::FusedAdamW fused(fused_params, options());
  for (int64_t step = 1; step <= 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    set_grads(reference_params, 100 + step);
    set_grads(fused_params, 100 + step);
    // Both start this step from the reference's state (the first from
    // none), so each step is compared alone.
    std::vector<at::Tensor> p0, m0, v0;
    for (size_t i = 0; i < reference_params.size(); ++i) {
      const at::Tensor& p = reference_params[i];
      p0.push_back(p.detach().cpu());
      const bool has = step > 1;
      m0.push_back(has ? state_of(reference, p).exp_avg().cpu() : at::zeros(p.sizes()));
      v0.push_back(has ? state_of(reference, p).exp_avg_sq().cpu() : at::zeros(p.sizes()));
      if (has) {
        at::NoGradGuard no_grad;
        fused_params[i].copy_(p);
        state_of(fused, fused_params[i]).exp_avg().copy_(state_of(reference, p).exp_avg());
        state_of(fused, fused_params[i]).exp_avg_sq().copy_(state_of(reference, p).exp_avg_sq());
      }
    }
    reference.step();
    fused.step();
    // libtorch 2.x has the fused CUDA kernel: the fused path ran.
    EXPECT_EQ(fused.last_step_fused(), optim::FusedAdamW::available());
    for (size_t i = 0; i < reference_params.size(); ++i) {
      SCOPED_TRACE("parameter " + std::to_string(i));
      const at::Tensor& r = reference_params[i];
      const at::Tensor& f = fused_params[i];
      EXPECT_TRUE(f.is_cuda());
      const AdamWParamState& rs = state_of(reference, r);
      const AdamWParamState& fs = state_of(fused, f);
      EXPECT_EQ(fs.step(), step);
      EXPECT_TRUE(fs.exp_avg().is_cuda());
      const StepBounds b = step_bounds(p0[i], m0[i], v0[i], r.grad().cpu(), step);
      EXPECT_TRUE(test::within_bound(fs.exp_avg().cpu(), rs.exp_avg().cpu(), b.m));
      EXPECT_TRUE(test::within_bound(fs.exp_avg_sq().cpu(), rs.exp_avg_sq().cpu(), b.v));
      EXPECT_TRUE(test::within_bound(f.detach().cpu(), r.detach().cpu(), b.p));
      // And it moved: a step that did nothing would be within the bound of
      // nothing.
      EXPECT_FALSE(at::equal(f.detach().cpu(), p0[i]));
    }
  }
}

}  // namespace
}  // namespace hp::cuda_test
