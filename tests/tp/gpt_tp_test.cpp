// Tensor parallelism of the GPT (S4, T7): the ready plan against one
// process — the fused QKV projection's strided split, loss parallel on
// vocabulary-sharded logits, and training steps (forward, every gradient,
// AdamW) within derived rounding bounds.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "hp/distributed/world.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/gpt_plan.h"
#include "hp/tp/shard_module.h"
#include "hp/util/error.h"
#include "tests/nn/gpt_sensitivity.h"
#include "tests/support/rounding_bounds.h"
#include "tests/tp/tp_test_util.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using test::tp_mesh;
using test::whole;

TEST(GptTensorParallel, FusedQkvSplitGivesEachRankItsOwnHeads) {
  const nn::GPTConfig config = test::tp_small_config();
  auto mesh = tp_mesh();
  nn::GPT plain = test::noisy_gpt(config, at::kDouble);
  nn::GPT model = test::noisy_gpt(config, at::kDouble);
  shard_module(model, mesh, gpt_tensor_parallel_plan(config, *mesh));

  const int64_t n = mesh->size(), r = mesh->coordinate(0), d = config.n_embd;
  const int64_t heads_here = config.n_head / n, hd = config.head_dim();
  auto plain_params = plain->named_parameters();
  auto params = model->named_parameters();
  ASSERT_EQ(params.size(), plain_params.size());
  for (const auto& p : plain_params) {
    // Names and global shapes are GPT-2's; the global values are the plain ones.
    ASSERT_TRUE(params.contains(p.key())) << p.key();
    EXPECT_EQ(params[p.key()].sizes(), p.value().sizes()) << p.key();
    EXPECT_TRUE(at::equal(whole(params[p.key()]), p.value())) << p.key();
  }
  if (n == 1) {
    // One rank needs no tensor parallelism: shard_module leaves the model.
    for (const auto& p : params) EXPECT_FALSE(is_dtensor(p.value())) << p.key();
    return;
  }
  for (int64_t layer = 0; layer < config.n_layer; ++layer) {
    const std::string name = "h." + std::to_string(layer) + ".attn.c_attn.weight";
    const at::Tensor full = plain_params[name];
    std::vector<at::Tensor> mine;
    for (int64_t block = 0; block < 3; ++block) {  // q, k, v
      mine.push_back(full.narrow(0, block * d + r * heads_here * hd, heads_here * hd));
    }
    EXPECT_TRUE(at::equal(local_of(params[name]), at::cat(mine))) << name;
    EXPECT_EQ(layout_of(params[name]).placements(), Placements{StridedShard(0, 3)});
  }
}

TEST(GptTensorParallel, PlanRefusesHeadsThatDoNotDivide) {
  nn::GPTConfig config = test::tp_small_config();
  config.n_head = 1;
  config.n_embd = 48;
  auto mesh = tp_mesh();
  if (mesh->size() == 1) GTEST_SKIP() << "one head divides by one rank";
  EXPECT_THAT([&] { gpt_tensor_parallel_plan(config, *mesh); },
              ThrowsMessage<ArgumentError>(HasSubstr("n_head 1 is not divisible by the "
                                                     "tensor-parallel size")));
  EXPECT_THAT([&] { gpt_tensor_parallel_plan(test::tp_small_config(), *mesh, "dp"); },
              ThrowsMessage<ArgumentError>(HasSubstr("tp_dim 'dp' is not a dim of")));
}

// Cross-entropy of logits sharded by vocabulary, computed without gathering
// them, against the plain loss. Bounds (float64, u = 2^-53): the row max is
// exact; the exp-sum S_i of V positive terms is reordered (across shards),
// so it moves by at most 4 V u S_i, its log by 4 V u, plus a few u for exp
// and log themselves (counted as 4 u); the loss adds the N rows' terms in
// another order: 4 N u Σ|l_i| / N more. The logits' gradient
// (softmax - onehot) / N moves with S: at most (softmax + 1)(4 V + 8) u / N.
TEST(GptTensorParallel, LossParallelMatchesCrossEntropy) {
  auto mesh = tp_mesh();
  const int64_t B = 3, T = 5, V = 50;
  auto gen = at::detail::createCPUGenerator(5);
  at::Tensor logits = torch::randn({B, T, V}, gen, torch::kDouble) * 3;
  at::Tensor targets = torch::randint(V, {B, T}, gen, torch::kLong);

  at::Tensor plain = logits.clone().requires_grad_(true);
  at::Tensor loss_plain = nn::cross_entropy(plain, targets);
  loss_plain.backward();

  at::Tensor sharded = distribute(logits.clone().requires_grad_(true), Layout(mesh, {Shard(2)}));
  at::Tensor loss = nn::cross_entropy(sharded, targets);
  if (mesh->size() > 1) {
    EXPECT_TRUE(layout_of(loss).placements()[0].is_partial()) << layout_of(loss).str();
  }
  loss.backward();
  EXPECT_EQ(layout_of(sharded.grad()).placements(), Placements{Shard(2)});

  const double u = test::unit_roundoff(at::kDouble);
  const int64_t N = B * T;
  at::Tensor per_row = torch::nn::functional::cross_entropy(
      logits.view({N, V}), targets.view({N}),
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
  const double loss_bound =
      (4.0 * V + 4) * u + 4.0 * N * u * per_row.abs().sum().item<double>() / N;
  EXPECT_TRUE(test::within_bound(loss.item<double>(), loss_plain.item<double>(), loss_bound));
  at::Tensor grad_bound = (logits.softmax(-1) + 1) * ((4.0 * V + 8) * u / N);
  EXPECT_TRUE(test::within_bound(full_tensor(sharded.grad()), plain.grad(), grad_bound));
}

// Three training steps against one process, in float64. Each step starts
// both from the reference's parameters, so the bounds of one step apply:
// the forward, the loss and every gradient within 4 n_max u S (S measured on
// the reference, see tests/nn/gpt_sensitivity.h: tensor parallelism splits
// the sums of the row-parallel products, the vocabulary's softmax sums and
// the replicated parameters' gradient sums into per-rank partial sums added
// by all-reduce, a reordering of the same terms), and the parameters after
// AdamW within what AdamWBound derives from the gradient bounds (the two
// optimizers' moments may drift apart by those bounds step after step).
TEST(GptTensorParallel, TrainsLikeOneProcess) {
  const nn::GPTConfig config = test::tp_small_config();
  auto mesh = tp_mesh();
  const test::AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1};
  auto adamw_options = torch::optim::AdamWOptions(hyper.lr)
                           .betas({hyper.beta1, hyper.beta2})
                           .eps(hyper.eps)
                           .weight_decay(hyper.weight_decay);
  nn::GPT reference = test::noisy_gpt(config, at::kDouble);
  nn::GPT model = test::noisy_gpt(config, at::kDouble);
  shard_module(model, mesh, gpt_tensor_parallel_plan(config, *mesh));
  torch::optim::AdamW ref_opt(reference->parameters(), adamw_options);
  torch::optim::AdamW opt(model->parameters(), adamw_options);
  test::AdamWBound adam(hyper);

  auto gen = at::detail::createCPUGenerator(99);
  const int64_t B = 3, T = config.context;
  const int64_t n_max = std::max({4 * config.n_embd, B * T, config.vocab_size});
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor idx = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
    at::Tensor targets = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
    test::load_into(model, reference);
    const nn::Sensitivity s = nn::measure_sensitivity(reference, config, idx, targets);
    auto bound = [&](const std::string& name) {
      return torch::scalar_tensor(test::reordered_sum_bound(s.per_unit.at(name), n_max, at::kDouble),
                                  torch::kDouble);
    };
    const nn::Named want = nn::forward_backward(reference, idx, targets);
    const nn::Named got = nn::forward_backward(model, idx, targets);
    EXPECT_TRUE(test::within_bound(whole(got.at("logits")), want.at("logits"), bound("logits")));
    EXPECT_TRUE(test::within_bound(whole(got.at("loss")), want.at("loss"), bound("loss")));
    std::map<std::string, at::Tensor> before, grad_bound;
    for (const auto& p : model->named_parameters()) {
      const std::string g = "grad." + p.key();
      if (is_dtensor(p.value())) {
        EXPECT_EQ(layout_of(p.value().grad()), layout_of(p.value())) << g;
      }
      grad_bound[p.key()] = bound(g);
      EXPECT_TRUE(test::within_bound(whole(got.at(g)), want.at(g), grad_bound[p.key()])) << g;
      before[p.key()] = whole(p.value()).detach().clone();
    }
    opt.step();
    ref_opt.step();
    auto ref_params = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      at::Tensor b = adam.step(p.key(), before.at(p.key()), want.at("grad." + p.key()),
                               grad_bound.at(p.key()));
      EXPECT_TRUE(test::within_bound(whole(p.value()), ref_params[p.key()], b)) << p.key();
    }
  }
}

}  // namespace
}  // namespace hp
