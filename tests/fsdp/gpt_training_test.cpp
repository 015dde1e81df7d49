// fully_shard on the GPT against plain libtorch in one process:
// 3 AdamW steps on FSDP, HSDP and DDP with reshard_after_forward true and
// false; gradient accumulation without sync; "sum" vs "avg"; distributed
// gradient clipping.
//
// The reference is plain libtorch in one process that processes the global
// batch as the ranks' slices (gradient accumulation over D micro-batches,
// then a division by D), which is the arithmetic data parallelism performs.
// Training steps each start from the reference's parameters
// (expect_training_matches says why).
//
// Tolerances: none is a constant. Each rank computes its slice bit for bit
// as the reference does, so losses and gradients may differ only by the
// order their D terms are added in: reordered_sum_bound of the terms the
// reference recorded (tests/fsdp/data_parallel_reference.h). Parameters
// after AdamW are held to AdamWBound of those gradient bounds, which is
// tight where |g| >> eps and up to ~2 lr where Adam amplifies rounding (the
// key bias, the middle third of c_attn.bias, has an exactly zero gradient:
// softmax ignores a shift shared by all keys, so its computed gradient is
// rounding noise).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/comm_stats.h"
#include "hp/fsdp/clip_grad.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

using test::kBatch;
using test::my_first_row;
using test::my_rows;

TEST(GPTFullyShard, ThreeAdamWStepsMatchPlainLibtorch) {
  for (const auto& mesh : test::mesh_configs()) {
    for (bool reshard : {true, false}) {
      SCOPED_TRACE(mesh.name + (reshard ? " reshard_after_forward" : " keep after forward"));
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.reshard_after_forward = reshard;
      test::expect_training_matches(options);
    }
  }
}

TEST(GPTFullyShard, AccumulationWithoutSyncEqualsOneBigBatch) {
  for (const auto& mesh : test::mesh_configs()) {
    for (const auto& reduction : test::gpt_reductions()) {
      SCOPED_TRACE(mesh.name + ", " + reduction.name);
      auto reference = test::make_gpt();
      auto ref_opt = test::make_adamw(*reference);
      auto model = test::make_gpt();
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = reduction.comm_fusion;
      FSDPModule root = test::shard_gpt(model, options, reduction.replicated);
      auto opt = test::make_adamw(*model);
      // The global batch of 4 * 12 rows in one go...
      at::Tensor tokens = at::cat({test::token_batch(0), test::token_batch(1),
                                   test::token_batch(2), test::token_batch(3)});
      test::reference_backward(reference, tokens, 4 * dist::get_world_size());
      // ... and as 4 micro-batches of 12, each rank its own slice of each;
      // only the last backward synchronises: the others reduce nothing.
      for (int micro = 0; micro < 4; ++micro) {
        root.set_requires_gradient_sync(micro == 3);
        dist::reset_comm_stats();
        at::Tensor loss =
            test::gpt_loss(model, tokens, micro * kBatch + my_first_row(), my_rows());
        (loss / 4).backward();
        if (micro < 3) {
          EXPECT_EQ(dist::comm_stats()[dist::OpType::kReduceScatter], 0)
              << "no-sync micro-batch " << micro;
          EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllReduce], 0)
              << "no-sync micro-batch " << micro;
        }
      }
      auto bounds = test::expect_gradients_match(model, reference);
      test::AdamWBound adam(test::adamw_hyper());
      test::step_and_expect_parameters_match(model, reference, opt, ref_opt, adam, bounds);
    }
  }
}

// "sum" is "avg" times the number of ranks: the reference's gradient times
// that number, within its bound scaled alike (gradient_bounds' scale), for
// the sharded parameters and for those kept whole.
TEST(GPTFullyShard, SumIsAverageTimesDataParallelSize) {
  const double dp_size = dist::get_world_size();
  for (const auto& mesh : test::mesh_configs()) {
    for (const auto& reduction : test::gpt_reductions()) {
      SCOPED_TRACE(mesh.name + ", " + reduction.name);
      auto reference = test::make_gpt();
      auto model = test::make_gpt();
      FullyShardOptions options;
      options.mesh = test::make_mesh(mesh);
      options.comm_fusion = reduction.comm_fusion;
      FSDPModule root = test::shard_gpt(model, options, reduction.replicated);
      root.set_reduce_op_type("sum");
      at::Tensor tokens = test::token_batch(0, kBatch);
      test::reference_backward(reference, tokens, dist::get_world_size());
      test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
      test::expect_gradients_match(model, reference, dp_size);
    }
  }
}

TEST(GPTFullyShard, ClipGradNormMatchesOneProcess) {
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    auto reference = test::make_gpt();
    auto model = test::make_gpt();
    FullyShardOptions options;
    options.mesh = test::make_mesh(mesh);
    test::shard_gpt(model, options);
    at::Tensor tokens = test::token_batch(0, kBatch);
    test::reference_backward(reference, tokens, dist::get_world_size());
    test::gpt_loss(model, tokens, my_first_row(), my_rows()).backward();
    const double max_norm = 0.05;  // below the gradient's norm: clipping happens
    const double ref_norm =
        torch::nn::utils::clip_grad_norm_(reference->parameters(), max_norm);
    const double norm = clip_grad_norm_(model->parameters(), max_norm).item<double>();
    EXPECT_GT(ref_norm, max_norm);
    // The norms differ by the gradients' difference, at most the 2-norm of
    // their bounds, plus each side's rounding of the norm: a sum of N
    // non-negative squares in any order is within (N - 1) u of exact
    // relatively, the squares, the per-tensor and the final square roots
    // add a few u, so 2 (N + 4) u ref_norm covers both sides (the worst
    // case, far above what blocked sums reach; a norm that misses a shard or
    // counts a replica twice is off by tens of percent).
    auto grad_bounds = test::gradient_bounds(reference);
    double bounds_sq = 0, n = 0;
    for (auto& [name, b] : grad_bounds) {
      bounds_sq += b.pow(2).sum().item<double>();
      n += b.numel();
    }
    const double u = test::unit_roundoff(at::kFloat);
    const double norm_bound = std::sqrt(bounds_sq) + 2 * (n + 4) * u * ref_norm;
    EXPECT_TRUE(test::within_bound(norm, ref_norm, norm_bound)) << "total norm";
    // Both sides scale by max_norm / (norm + 1e-6): coefficients within a
    // relative norm_bound / ref_norm of each other (plus their rounding), and
    // one more rounding in the product.
    const double coef = max_norm / (ref_norm + 1e-6);
    const double coef_relative = norm_bound / ref_norm + 3 * u;
    std::map<std::string, at::Tensor> clipped_bounds;
    for (auto& item : reference->named_parameters()) {
      clipped_bounds[item.key()] = grad_bounds.at(item.key()) * coef +
                                   coef_relative * item.value().grad().abs().to(at::kDouble);
    }
    test::expect_gradients_within(model, reference, clipped_bounds);
    // The infinity norm is a max (exact) over the clipped gradients, each
    // within its bound.
    double inf_ref = 0, inf_bound = 0;
    for (auto& p : reference->parameters()) {
      inf_ref = std::max(inf_ref, p.grad().abs().max().item<double>());
    }
    for (auto& [name, b] : clipped_bounds) inf_bound = std::max(inf_bound, b.max().item<double>());
    const double inf = clip_grad_norm_(model->parameters(), 1e9, INFINITY).item<double>();
    EXPECT_TRUE(test::within_bound(inf, inf_ref, inf_bound))
        << "infinity norm";
  }
}

}  // namespace
}  // namespace hp
