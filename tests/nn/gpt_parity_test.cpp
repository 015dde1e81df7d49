// Parity with PyTorch (N2, N3): the same weights and batch give the
// same logits, loss, every parameter's gradient and one AdamW step in this
// GPT and in tests/nn/gpt_reference.py (PyTorch 1.13), and the same seed gives
// the same initial weights. The reference runs in Debian's /usr/bin/python3;
// without python3-torch the test fails (CI installs it), it does not skip.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "tests/nn/raw_tensors.h"
#include "tests/support/tensor_checks.h"

#ifndef HP_SOURCE_DIR
#error "HP_SOURCE_DIR (the repository root) must be defined by the build"
#endif

namespace hp::nn {
namespace {

// fp32 throughout, but the two sides need not sum in the same order (BLAS
// blocking, fused vs. separate kernels), which moves results by a few ulp of
// the largest term: ~1e-6 relative after a few layers of d = 32 dot products.
// 1e-5 relative leaves margin while still catching any semantic difference
// (a wrong scale, mask, eps or GELU form moves values by 1e-3 or more); atol
// covers gradients that are zero up to rounding.
constexpr double kRtol = 1e-5;
constexpr double kAtol = 1e-6;

struct TempDir {
  TempDir() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "hp_gpt_parity_XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = pattern;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string path;
};

// Runs `command`, returning its exit status and its stdout + stderr.
std::pair<int, std::string> run(const std::string& command) {
  std::string output;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {-1, "popen failed"};
  std::array<char, 4096> buffer;
  while (size_t n = fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

// max |a - e| and max |a - e| / max(|e|, atol).
std::string diff_summary(const at::Tensor& a, const at::Tensor& e) {
  at::Tensor abs = (a - e).abs();
  at::Tensor rel = abs / e.abs().clamp_min(kAtol);
  std::ostringstream out;
  out << std::scientific << std::setprecision(2) << "max abs " << abs.max().item<double>()
      << ", max rel " << rel.max().item<double>();
  return out.str();
}

TEST(GPTParity, MatchesPyTorchForwardBackwardAndAdamWStep) {
  GPTConfig config;
  config.vocab_size = 50;
  config.context = 16;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_embd = 32;
  const uint64_t seed = 1234;
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;

  torch::manual_seed(seed);
  GPT model(config);
  auto gen = at::detail::createCPUGenerator(99);
  at::Tensor idx = torch::randint(config.vocab_size, {3, config.context}, gen, torch::kLong);
  at::Tensor targets = torch::randint(config.vocab_size, {3, config.context}, gen, torch::kLong);

  std::map<std::string, at::Tensor> init;
  for (const auto& p : model->named_parameters()) init.emplace(p.key(), p.value().clone());
  // GPT-2's initial weights keep every activation near 0.02, where each layer
  // is almost linear and a wrong GELU form, scale or mask hardly shows. Noise
  // of unit-scale activations makes every such difference visible.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) {
      const double scale = p.dim() == 2 ? 1.0 / std::sqrt(double(p.size(1))) : 0.1;
      p.add_(torch::randn(p.sizes(), gen) * scale);
    }
  }

  TempDir dir;
  std::map<std::string, at::Tensor> inputs{{"idx", idx}, {"targets", targets}};
  for (const auto& p : model->named_parameters()) inputs.emplace(p.key(), p.value());
  test::write_raw_tensors(dir.path, "inputs", inputs);
  nlohmann::json json_config = {{"vocab_size", config.vocab_size},
                                {"context", config.context},
                                {"n_layer", config.n_layer},
                                {"n_head", config.n_head},
                                {"n_embd", config.n_embd},
                                {"seed", seed},
                                {"adamw",
                                 {{"lr", lr},
                                  {"beta1", beta1},
                                  {"beta2", beta2},
                                  {"eps", eps},
                                  {"weight_decay", weight_decay}}}};
  std::ofstream(dir.path + "/config.json") << json_config.dump();

  const std::string script = std::string(HP_SOURCE_DIR) + "/tests/nn/gpt_reference.py";
  auto [status, output] = run("/usr/bin/python3 " + script + " " + dir.path);
  ASSERT_EQ(status, 0) << "the PyTorch reference failed (it needs Debian's python3-torch and "
                          "python3-numpy: scripts/install-deps.sh):\n"
                       << output;
  auto ref = test::read_raw_tensors(dir.path, "outputs");

  at::Tensor logits = model(idx);
  at::Tensor loss = cross_entropy(logits, targets);
  loss.backward();

  auto expect_close = [&](const std::string& what, const at::Tensor& actual,
                          const at::Tensor& expected) {
    EXPECT_TRUE(test::tensors_close(actual, expected, kRtol, kAtol)) << what;
    std::cout << "  " << what << ": " << diff_summary(actual.detach(), expected) << "\n";
  };
  std::cout << "parity with PyTorch:\n";
  expect_close("logits", logits, ref.at("logits"));
  expect_close("loss", loss, ref.at("loss"));
  std::vector<at::Tensor> actual_grads, expected_grads;
  for (const auto& p : model->named_parameters()) {
    const at::Tensor& expected = ref.at("grad." + p.key());
    EXPECT_TRUE(test::tensors_close(p.value().grad(), expected, kRtol, kAtol))
        << "grad." << p.key();
    actual_grads.push_back(p.value().grad().flatten());
    expected_grads.push_back(expected.flatten());
    // Same seed, same draws, same kernels: PyTorch's initial weights exactly.
    EXPECT_TRUE(test::tensors_equal(init.at(p.key()), ref.at("init." + p.key()))) << p.key();
  }
  std::cout << "  all gradients: "
            << diff_summary(torch::cat(actual_grads), torch::cat(expected_grads)) << "\n";

  torch::optim::AdamW optimizer(
      model->parameters(),
      torch::optim::AdamWOptions(lr).betas({beta1, beta2}).eps(eps).weight_decay(weight_decay));
  optimizer.step();
  std::vector<at::Tensor> actual_step, expected_step;
  for (const auto& p : model->named_parameters()) {
    EXPECT_TRUE(test::tensors_close(p.value(), ref.at("step." + p.key()), kRtol, kAtol))
        << "step." << p.key();
    actual_step.push_back(p.value().detach().flatten());
    expected_step.push_back(ref.at("step." + p.key()).flatten());
  }
  std::cout << "  parameters after AdamW step: "
            << diff_summary(torch::cat(actual_step), torch::cat(expected_step)) << "\n";
  torch::NoGradGuard no_grad;
  expect_close("loss after step", cross_entropy(model(idx), targets), ref.at("step.loss"));
}

}  // namespace
}  // namespace hp::nn
