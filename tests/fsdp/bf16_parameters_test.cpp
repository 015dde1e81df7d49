// bf16 compute with fp32 shards and fp32 reduction: after a few
// optimizer steps the fp32 parameters stay within a bound derived from
// bf16's precision of the fp32 model's.
//
// The bound. Plain SGD (no momentum, no weight decay) at rate lr makes a
// parameter after T steps p0 - lr * sum_t g_t, so the two runs differ by at
// most lr * sum_t |g_bf16_t - g_t| (plus a second-order term: step t's
// gradient also sees the parameters already apart, by lr * |H| * |dp|,
// negligible at this lr). bf16 keeps 8 significant bits (eps 2^-8 ~ 0.4 %);
// the gradient of an entry accumulates the rounding of every bf16 operand on
// its path through the 2-block GPT, which the gradient bound of
// performance_features_test.cpp puts at 10 % (about 25 eps) of the tensor's
// largest entry. Hence, per tensor,
//   |p_bf16 - p| <= lr * sum_t 0.1 * max|g_t|.
// A lost update (the optimizer stepping a copy, or the bf16 compute copy
// written back over the step) moves the large-gradient entries by about
// lr * max|g_t| per step, ten times the bound.
// Adam is not used here: its first steps are nearly lr * sign(g), so a sign
// flipped by bf16 noise on a small gradient moves the entry by 2 lr whatever
// the precision, and no bound below that follows from eps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/fsdp/fully_shard.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

TEST(MixedPrecisionParameters, Bf16ComputeTracksFp32WithinEpsTimesSteps) {
  constexpr double kLr = 0.1;
  constexpr double kRelativeGradError = 0.1;  // of max|g|, see above
  constexpr int kSteps = 3;
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "fused" : "per parameter");
    FullyShardOptions options;
    options.mp_policy.param_dtype = at::kBFloat16;
    options.mp_policy.reduce_dtype = at::kFloat;
    options.mp_policy.output_dtype = at::kFloat;
    options.comm_fusion = fused;
    auto reference = test::make_gpt();
    auto model = test::make_gpt();
    std::map<std::string, at::Tensor> initial;
    for (auto& item : reference->named_parameters()) initial[item.key()] = item.value().clone();
    test::shard_gpt(model, options);
    torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(kLr));
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(kLr));
    std::map<std::string, double> bound, moved;
    for (int step = 0; step < kSteps; ++step) {
      at::Tensor tokens = test::token_batch(step, test::kBatch);
      test::reference_backward(reference, tokens, dist::get_world_size());
      test::gpt_loss(model, tokens, test::my_first_row(), test::my_rows()).backward();
      for (auto& item : reference->named_parameters()) {
        const double largest = item.value().grad().abs().max().item<double>();
        bound[item.key()] += kLr * kRelativeGradError * largest;
        moved[item.key()] += kLr * largest;
      }
      ref_opt.step();
      ref_opt.zero_grad();
      opt.step();
      opt.zero_grad();
    }
    auto gathered = test::full_parameters(*model);
    for (auto& item : reference->named_parameters()) {
      const std::string& name = item.key();
      EXPECT_EQ(gathered.at(name).scalar_type(), at::kFloat) << name;
      EXPECT_TRUE(test::tensors_close(gathered.at(name), item.value(), 0, bound.at(name)))
          << name << " bound " << bound.at(name);
      // The comparison can fail: the reference moved by more than the bound.
      EXPECT_GT((item.value() - initial.at(name)).abs().max().item<double>(), bound.at(name))
          << name << " moved at most " << moved.at(name);
    }
  }
}

}  // namespace
}  // namespace hp
