// Tensor parallelism of the Llama (S6): its plan alone over every rank, and
// under fully_shard on every (dp, tp) mesh of the world (F16), against one
// process: forward, loss, every gradient and AdamW steps in float64 within
// the bounds derived as for the GPT (tests/tp/gpt_tp_test.cpp,
// tests/nn/gpt_sensitivity.h). Rotary embedding and grouped-query attention
// run on head-sharded DTensors through the op rules. Run on 2 and 4 ranks
// (the config's 8 query and 4 key/value heads divide by both; 50 vocabulary
// rows do not divide by 4: uneven shards).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "hp/distributed/world.h"
#include "hp/fsdp/fsdp_param.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/registry.h"
#include "hp/nn/llama.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/llama_plan.h"
#include "hp/tp/shard_module.h"
#include "hp/util/error.h"
#include "tests/nn/model_sensitivity.h"
#include "tests/support/rounding_bounds.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

nn::LlamaConfig tp_config() {
  nn::LlamaConfig config;
  config.vocab_size = 50;
  config.context = 8;
  config.n_layer = 2;
  config.n_head = 8;
  config.n_kv_head = 4;
  config.n_embd = 32;
  config.intermediate_size = 44;
  config.rope_theta = 100.0;
  return config;
}

// Seeded, with unit-scale noise (as tests/tp/tp_test_util.h's noisy_gpt).
nn::Llama noisy_llama(const nn::LlamaConfig& config) {
  torch::manual_seed(1234);
  nn::Llama model(config);
  model->to(at::kDouble);
  auto gen = at::detail::createCPUGenerator(77);
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) {
    const double scale = p.dim() == 2 ? 1.0 / std::sqrt(double(p.size(1))) : 0.1;
    p.add_(torch::randn(p.sizes(), gen).to(at::kDouble) * scale);
  }
  return model;
}

// The global value of a parameter or its .grad: a DTensor gathered, a
// fully_shard shard through its unit's layout.
at::Tensor global_value(const at::Tensor& param, const at::Tensor& value) {
  torch::NoGradGuard no_grad;
  if (is_dtensor(value)) return full_tensor(value);
  auto managed = fsdp::find_managed(param);
  if (!managed) return value.detach();
  const fsdp::FSDPParam& p = *managed->param;
  return from_local(value.detach(), p.shard_layout(), {p.global_shape()}).full_tensor();
}

// Copies `source`'s whole parameters into `target`'s pieces.
void load_into(nn::Llama& target, nn::Llama& source) {
  torch::NoGradGuard no_grad;
  auto from = source->named_parameters();
  for (auto& p : target->named_parameters()) {
    const at::Tensor& full = from[p.key()];
    auto managed = fsdp::find_managed(p.value());
    if (is_dtensor(p.value())) {
      local_of(p.value()).copy_(local_of(distribute(full, layout_of(p.value()))));
    } else if (managed) {
      p.value().copy_(distribute_tensor(full, managed->param->shard_layout()).local());
    } else {
      p.value().copy_(full);
    }
  }
}

// Three steps on `mesh` (dims "dp", "tp"); the model is already
// parallelized; `b` samples per data-parallel rank.
void expect_trains_like_one_process(nn::Llama& reference, nn::Llama& model, int64_t dp,
                                    int64_t dp_rank) {
  const nn::LlamaConfig config = tp_config();
  const test::AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1};
  auto adamw_options = torch::optim::AdamWOptions(hyper.lr)
                           .betas({hyper.beta1, hyper.beta2})
                           .eps(hyper.eps)
                           .weight_decay(hyper.weight_decay);
  torch::optim::AdamW ref_opt(reference->parameters(), adamw_options);
  torch::optim::AdamW opt(model->parameters(), adamw_options);
  test::AdamWBound adam(hyper);
  auto gen = at::detail::createCPUGenerator(99);
  const int64_t b = 2, B = b * dp, T = config.context;
  // The longest sum (tests/nn/gpt_sensitivity.h), plus one term for the
  // data-parallel average of the gradients when dp > 1.
  const int64_t n_max =
      std::max({config.intermediate_size, config.n_embd, B * T, config.vocab_size}) + 1;
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    at::Tensor idx = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
    at::Tensor targets = torch::randint(config.vocab_size, {B, T}, gen, torch::kLong);
    load_into(model, reference);
    const test::ModelSensitivity s = test::model_sensitivity(reference, config, idx, targets);
    auto bound = [&](const std::string& name) {
      return torch::scalar_tensor(
          test::reordered_sum_bound(s.per_unit.at(name), n_max, at::kDouble), torch::kDouble);
    };
    const test::NamedTensors want = test::forward_backward_of(reference, idx, targets);
    const test::NamedTensors got = test::forward_backward_of(
        model, idx.narrow(0, dp_rank * b, b), targets.narrow(0, dp_rank * b, b));
    EXPECT_TRUE(test::within_bound(global_value(got.at("logits"), got.at("logits")),
                                   want.at("logits").narrow(0, dp_rank * b, b),
                                   bound("logits")));
    std::map<std::string, at::Tensor> before, grad_bound;
    for (const auto& p : model->named_parameters()) {
      const std::string g = "grad." + p.key();
      ASSERT_TRUE(p.value().grad().defined()) << g;
      grad_bound[p.key()] = bound(g);
      EXPECT_TRUE(test::within_bound(global_value(p.value(), p.value().grad()), want.at(g),
                                     grad_bound[p.key()]))
          << g;
      before[p.key()] = global_value(p.value(), p.value()).clone();
    }
    opt.step();
    ref_opt.step();
    auto ref_params = reference->named_parameters();
    for (const auto& p : model->named_parameters()) {
      at::Tensor bnd = adam.step(p.key(), before.at(p.key()), want.at("grad." + p.key()),
                                 grad_bound.at(p.key()));
      EXPECT_TRUE(
          test::within_bound(global_value(p.value(), p.value()), ref_params[p.key()], bnd))
          << p.key();
    }
    opt.zero_grad();
  }
}

TEST(LlamaTensorParallel, PlanShardsHeadsAndKeepsNames) {
  const nn::LlamaConfig config = tp_config();
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
  nn::Llama plain = noisy_llama(config);
  nn::Llama model = noisy_llama(config);
  shard_module(model, mesh, llama_tensor_parallel_plan(config, *mesh));
  auto params = model->named_parameters();
  for (const auto& p : plain->named_parameters()) {
    ASSERT_TRUE(params.contains(p.key())) << p.key();
    EXPECT_EQ(params[p.key()].sizes(), p.value().sizes()) << p.key();
    EXPECT_TRUE(at::equal(global_value(params[p.key()], params[p.key()]), p.value())) << p.key();
  }
  const int64_t n = mesh->size(), r = mesh->coordinate(0), hd = config.head_dim();
  const std::string k = "model.layers.1.self_attn.k_proj.weight";
  const int64_t kv_here = config.n_kv_head / n;
  EXPECT_TRUE(at::equal(local_of(params[k]),
                        plain->named_parameters()[k].narrow(0, r * kv_here * hd, kv_here * hd)));
}

TEST(LlamaTensorParallel, PlanRefusesHeadsThatDoNotDivide) {
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
  nn::LlamaConfig config = tp_config();
  config.n_kv_head = 1;
  EXPECT_THAT([&] { llama_tensor_parallel_plan(config, *mesh); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "LlamaConfig.n_kv_head 1 is not divisible by the tensor-parallel size")));
  config = tp_config();
  config.n_head = 4 * mesh->size() + 1;
  config.n_kv_head = 1;
  config.n_embd = 2 * config.n_head;
  EXPECT_THAT([&] { llama_tensor_parallel_plan(config, *mesh); },
              ThrowsMessage<ArgumentError>(HasSubstr(fmt::format(
                  "LlamaConfig.n_head {} is not divisible by the tensor-parallel size",
                  config.n_head))));
}

TEST(LlamaTensorParallel, TrainsLikeOneProcess) {
  const nn::LlamaConfig config = tp_config();
  auto mesh = init_device_mesh("cpu", {dist::get_world_size()}, {"tp"});
  nn::Llama reference = noisy_llama(config);
  nn::Llama model = noisy_llama(config);
  shard_module(model, mesh, llama_tensor_parallel_plan(config, *mesh));
  expect_trains_like_one_process(reference, model, /*dp=*/1, /*dp_rank=*/0);
}

// The plan over mesh["tp"], then every decoder layer and the root a
// fully_shard unit over mesh["dp"], on every (dp, tp) of the world.
TEST(LlamaFsdpTp, TrainsLikeOneProcess) {
  const nn::LlamaConfig config = tp_config();
  const int64_t n = dist::get_world_size();
  for (int64_t dp = 1; dp <= n; ++dp) {
    if (n % dp != 0) continue;
    SCOPED_TRACE(fmt::format("mesh {}x{}", dp, n / dp));
    auto mesh = init_device_mesh("cpu", {dp, n / dp}, {"dp", "tp"});
    nn::Llama reference = noisy_llama(config);
    nn::Llama model = noisy_llama(config);
    shard_module(model, (*mesh)["tp"], llama_tensor_parallel_plan(config, *(*mesh)["tp"]));
    FullyShardOptions options;
    options.mesh = (*mesh)["dp"];
    for (const auto& layer : model->layers()) fully_shard(layer.ptr(), options);
    fully_shard(model.ptr(), options);
    expect_trains_like_one_process(reference, model, dp, mesh->coordinate(0));
  }
}

}  // namespace
}  // namespace hp
