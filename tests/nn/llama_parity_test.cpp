// Parity of hp::nn::Llama with PyTorch (N5): the same weights and batch
// give the same logits, loss, every parameter's gradient and one AdamW step
// here and in tests/nn/llama_reference.py, in float64 and float32, and the
// same seed gives the same initial weights bit for bit. The bounds are the
// GPT parity test's (tests/nn/gpt_parity_test.cpp, derivation in
// tests/nn/gpt_sensitivity.h): 4 n_max u S, S measured by probing every
// parameter, n_max the longest sum (here max(intermediate_size, n_embd,
// B*T, vocab)); the loss after the step is compared in float64 only, for
// the reason given there. The model is a grouped-query one (n_kv_head <
// n_head) with a non-default rope_theta and rms_norm_eps, so a slip in the
// kv-head grouping, the rotary convention or the norm shows.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "hp/nn/llama.h"
#include "hp/nn/loss.h"
#include "tests/nn/model_sensitivity.h"
#include "tests/nn/python_reference.h"
#include "tests/nn/raw_tensors.h"
#include "tests/support/model_configs.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"

namespace hp::nn {
namespace {

LlamaConfig parity_config() {
  LlamaConfig config = test::tiny_llama_config();
  config.rms_norm_eps = 1e-5;
  config.rope_theta = 500.0;  // large angles within 16 positions
  return config;
}

TEST(LlamaParity, MatchesPyTorchForwardBackwardAndAdamWStep) {
  const LlamaConfig config = parity_config();
  const uint64_t seed = 1234;
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;

  torch::manual_seed(seed);
  Llama model(config);
  auto gen = at::detail::createCPUGenerator(99);
  at::Tensor idx = torch::randint(config.vocab_size, {3, config.context}, gen, torch::kLong);
  at::Tensor targets = torch::randint(config.vocab_size, {3, config.context}, gen, torch::kLong);

  std::map<std::string, at::Tensor> init;
  for (const auto& p : model->named_parameters()) init.emplace(p.key(), p.value().clone());
  // As in the GPT's test: unit-scale activations, so that every nonlinearity
  // (and the norms' weights, which start at exactly 1) matters.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      const double scale = p.dim() == 2 ? 1.0 / std::sqrt(double(p.size(1))) : 0.1;
      p.add_(torch::randn(p.sizes(), gen) * scale);
    }
  }

  test::ReferenceDir dir;
  std::map<std::string, at::Tensor> inputs{{"idx", idx}, {"targets", targets}};
  for (const auto& p : model->named_parameters()) inputs.emplace(p.key(), p.value());
  test::write_raw_tensors(dir.path, "inputs", inputs);
  nlohmann::json json_config = {
      {"vocab_size", config.vocab_size},
      {"n_layer", config.n_layer},
      {"n_head", config.n_head},
      {"n_kv_head", config.n_kv_head},
      {"n_embd", config.n_embd},
      {"intermediate_size", config.intermediate_size},
      {"rms_norm_eps", config.rms_norm_eps},
      {"rope_theta", config.rope_theta},
      {"initializer_range", config.initializer_range},
      {"seed", seed},
      {"adamw",
       {{"lr", lr},
        {"beta1", beta1},
        {"beta2", beta2},
        {"eps", eps},
        {"weight_decay", weight_decay}}}};
  std::ofstream(dir.path + "/config.json") << json_config.dump();

  auto [status, output] = test::run_reference("llama_reference.py", dir.path);
  ASSERT_EQ(status, 0) << "the PyTorch reference failed (" HP_PYTHON " needs torch and numpy: "
                          "scripts/install-deps.sh):\n"
                       << output;
  auto ref = test::read_raw_tensors(dir.path, "outputs");

  // Same seed, same draws in the same order: the reference's weights exactly.
  ASSERT_EQ(init.size() + 0, model->named_parameters().size());
  for (const auto& [name, value] : init) {
    ASSERT_EQ(ref.count("init." + name), 1u) << name << " is not a parameter of the reference";
    EXPECT_TRUE(test::tensors_equal(value, ref.at("init." + name))) << name;
  }

  const int64_t n_max = std::max(
      {config.intermediate_size, config.n_embd, idx.numel(), config.vocab_size});
  const test::AdamWHyper hyper{lr, beta1, beta2, eps, weight_decay};
  const test::ModelSensitivity at_init = test::model_sensitivity(model, config, idx, targets);
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
    const std::string prefix = dtype == at::kFloat ? "float32." : "float64.";
    SCOPED_TRACE(prefix);
    auto bound = [&](const test::ModelSensitivity& s, const std::string& name) {
      return test::reordered_sum_bound(s.per_unit.at(name), n_max, dtype);
    };
    Llama m = test::model_copy(model, config, dtype);
    const test::NamedTensors got = test::forward_backward_of(m, idx, targets);
    for (const std::string name : {"logits", "loss"}) {
      const at::Tensor b = torch::scalar_tensor(bound(at_init, name), torch::kDouble);
      EXPECT_TRUE(test::within_bound(got.at(name), ref.at(prefix + name), b)) << name;
    }
    std::map<std::string, at::Tensor> grad_bound, before;
    for (const auto& p : m->named_parameters()) {
      const std::string name = "grad." + p.key();
      grad_bound[p.key()] = torch::scalar_tensor(bound(at_init, name), torch::kDouble);
      EXPECT_TRUE(test::within_bound(got.at(name), ref.at(prefix + name), grad_bound[p.key()]))
          << name;
      before[p.key()] = p.value().detach().clone();
    }

    torch::optim::AdamW optimizer(
        m->parameters(),
        torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(weight_decay));
    optimizer.step();
    test::AdamWBound adam(hyper);
    const test::ModelSensitivity after = test::model_sensitivity(m, config, idx, targets);
    double step_loss_bound = bound(after, "loss");  // used in float64 only
    for (const auto& p : m->named_parameters()) {
      const std::string name = "step." + p.key();
      at::Tensor b =
          adam.step(p.key(), before.at(p.key()), got.at("grad." + p.key()), grad_bound[p.key()]);
      EXPECT_TRUE(test::within_bound(p.value().detach(), ref.at(prefix + name), b)) << name;
      step_loss_bound += (after.base.at("grad." + p.key()).abs() * b).sum().item<double>();
    }
    if (dtype == at::kDouble) {
      torch::NoGradGuard no_grad;
      at::Tensor step_loss = cross_entropy(m(idx), targets);
      EXPECT_TRUE(test::within_bound(step_loss, ref.at(prefix + "step.loss"),
                                     torch::scalar_tensor(step_loss_bound, torch::kDouble)))
          << "step.loss";
    }
  }
}

}  // namespace
}  // namespace hp::nn
