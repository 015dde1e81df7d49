// bf16 compute with fp32 shards and fp32 reduction under plain SGD: every
// step updates the fp32 parameters, not a bf16 copy of them, and writes no
// bf16-rounded value back over them.
//
// The reference computes as each rank does (reference_backward with a bf16
// compute dtype: each slice on a bf16 copy of the fp32 parameters, the fp32
// casts of the slices' gradients summed), so its gradients differ from the
// reduced shards only by the order of their world-size terms: the reordering
// bound gb of the terms it recorded. How far bf16 compute drifts from an fp32
// model is not compared: no bound on it follows from bf16's precision short
// of a forward error analysis of the whole GPT, and a fixed allowance would
// be a tuned constant.
//
// The parameter bound. Each step starts both from the reference's
// parameters (a value apart by an fp32 ulp could round to another bf16
// value and change the next gradients beyond any reordering bound). SGD
// (no momentum, no weight decay) sets p - lr g, rounding lr g and the
// difference: each run is within u (|p| + 2 lr |g|) of its exact update, to
// first order, so the two differ by at most lr gb + 2 u (|p| + 2 lr (|g| +
// gb)). A lost update or a bf16 value written back moves an entry by up to
// lr |g| or 2^-8 |p|, far above it; the check that the reference moved by
// more than the bound shows the comparison can fail.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/fsdp/fully_shard.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/rounding_bounds.h"

namespace hp {
namespace {

TEST(MixedPrecisionParameters, Bf16ComputeSgdUpdatesFp32Shards) {
  constexpr double kLr = 0.1;
  constexpr int kSteps = 3;
  const int64_t parts = dist::get_world_size();
  const double u = test::unit_roundoff(at::kFloat);
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    FullyShardOptions options;
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
    options.mp_policy.output_dtype = at::kFloat;
    options.comm_fusion = fused;
    auto reference = test::make_gpt();
    auto model = test::make_gpt();
    test::shard_gpt(model, options);
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(kLr));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    for (int step = 0; step < kSteps; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      test::copy_parameters(model, reference);
      at::Tensor tokens = test::token_batch(step, test::kBatch);
      test::reference_backward(reference, tokens, parts, at::kBFloat16);
      test::gpt_loss(model, tokens, test::my_first_row(), test::my_rows()).backward();
      auto grad_bounds = test::expect_gradients_match(model, reference);
      std::map<std::string, at::Tensor> bounds, before;
      for (auto& item : reference->named_parameters()) {
        const at::Tensor p = item.value().detach().to(at::kDouble).abs();
        const at::Tensor g = item.value().grad().to(at::kDouble).abs();
        const at::Tensor& gb = grad_bounds.at(item.key());
        bounds[item.key()] = kLr * gb + 2 * u * (p + 2 * kLr * (g + gb));
        before[item.key()] = item.value().detach().clone();
      }
      ref_opt.step();
      ref_opt.zero_grad();
      opt.step();
      opt.zero_grad();
      auto gathered = test::full_parameters(*model);
      for (auto& item : reference->named_parameters()) {
        const std::string& name = item.key();
        EXPECT_EQ(gathered.at(name).scalar_type(), at::kFloat) << name;
        EXPECT_TRUE(test::within_bound(gathered.at(name), item.value(), bounds.at(name))) << name;
        // The comparison can fail: the step moved the reference by more
        // than the bound allows.
        EXPECT_GT((item.value() - before.at(name)).abs().max().item<double>(),
                  bounds.at(name).max().item<double>())
            << name;
      }
    }
  }
}

}  // namespace
}  // namespace hp
