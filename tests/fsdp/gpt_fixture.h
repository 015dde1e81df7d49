// A small GPT (2 layers, d 64) for fully_shard tests, its data and the
// sharding recipe every test uses: each block a unit, then the root.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

#include "hp/dist/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/support/tensor_checks.h"

namespace hp::test {

inline nn::GPTConfig small_gpt_config(int64_t layers = 2) {
  nn::GPTConfig c;
  c.vocab_size = 50;
  c.context = 16;
  c.n_layer = layers;
  c.n_head = 4;
  c.n_embd = 64;
  return c;
}

inline nn::GPT make_gpt(uint64_t seed = 7, int64_t layers = 2) {
  torch::manual_seed(seed);
  return nn::GPT(small_gpt_config(layers));
}

// Rows of the global batch of the parity tests.
constexpr int64_t kBatch = 12;

// This rank's rows of a global batch of kBatch (every rank is a
// data-parallel rank).
inline int64_t my_first_row() { return dist::get_rank() * (kBatch / dist::get_world_size()); }
inline int64_t my_rows() { return kBatch / dist::get_world_size(); }

// Tokens of step s: [batch, seq + 1], the same on every process.
inline at::Tensor token_batch(int step, int64_t batch = 12, int64_t seq = 8) {
  at::Generator gen = at::detail::createCPUGenerator(900 + step);
  return at::randint(0, 50, {batch, seq + 1}, gen, at::kLong);
}

// The single-process reference step: the global batch as `parts` equal
// micro-batches (the data-parallel ranks' slices), their gradients summed by
// accumulation and divided by `parts` — the arithmetic data parallelism does.
// Returns the mean loss.
at::Tensor reference_backward(nn::GPT& model, const at::Tensor& tokens, int64_t parts);

// Mean cross-entropy of `model` on rows [first, first + count) of `tokens`.
inline at::Tensor gpt_loss(nn::GPT& model, const at::Tensor& tokens, int64_t first,
                           int64_t count) {
  at::Tensor rows = tokens.narrow(0, first, count);
  at::Tensor inputs = rows.narrow(1, 0, rows.size(1) - 1);
  at::Tensor targets = rows.narrow(1, 1, rows.size(1) - 1);
  return nn::cross_entropy(model(inputs), targets);
}

inline at::Tensor reference_backward(nn::GPT& model, const at::Tensor& tokens, int64_t parts) {
  // Gradients from earlier calls are set aside and added back at the end,
  // as a second backward adds to .grad.
  std::vector<at::Tensor> earlier;
  for (auto& param : model->parameters()) {
    earlier.push_back(param.grad());
    param.mutable_grad() = at::Tensor();
  }
  const int64_t rows = tokens.size(0) / parts;
  at::Tensor total = at::zeros({});
  for (int64_t p = 0; p < parts; ++p) {
    at::Tensor loss = gpt_loss(model, tokens, p * rows, rows);
    loss.backward();
    total += loss.detach();
  }
  at::NoGradGuard no_grad;
  size_t i = 0;
  for (auto& param : model->parameters()) {
    at::Tensor& grad = param.mutable_grad();
    if (grad.defined()) grad.div_(parts);
    if (earlier[i].defined()) grad = grad.defined() ? grad + earlier[i] : earlier[i];
    ++i;
  }
  return total / parts;
}

// After a few AdamW steps: every whole parameter of the sharded `model`
// within `atol` of the reference's. The key bias (the middle third of
// c_attn.bias) has an exactly zero gradient (softmax ignores a shift shared
// by all keys): its computed gradient is rounding noise, which Adam turns
// into updates of ~lr * noise / eps, so it is held to `key_bias_atol`.
inline void expect_parameters_match(nn::Module& model, nn::GPT& reference, double atol,
                                    double key_bias_atol) {
  auto gathered = full_parameters(model);
  const int64_t d = reference->config().n_embd;
  for (auto& item : reference->named_parameters()) {
    at::Tensor actual = gathered.at(item.key()), expected = item.value();
    EXPECT_EQ(actual.scalar_type(), expected.scalar_type()) << item.key();
    if (item.key().find("attn.c_attn.bias") != std::string::npos) {
      EXPECT_TRUE(tensors_close(actual.narrow(0, d, d), expected.narrow(0, d, d), 0, key_bias_atol))
          << item.key() << " (key bias)";
      actual = at::cat({actual.narrow(0, 0, d), actual.narrow(0, 2 * d, d)});
      expected = at::cat({expected.narrow(0, 0, d), expected.narrow(0, 2 * d, d)});
    }
    EXPECT_TRUE(tensors_close(actual, expected, 0, atol)) << item.key();
  }
}

// How closely a sharded run must track the single-process reference. The
// defaults are the fp32 parity tolerances (gpt_training_test.cpp says why).
struct TrainingTolerances {
  double loss_rtol = 1e-5;
  double grad_rtol = 1e-5;
  double grad_atol = 1e-7;
  // > 0: gradients within this fraction of each tensor's largest entry (at
  // least 2e-6) instead of grad_atol (bf16 compute: near-zero entries carry
  // the absolute error of the large ones).
  double grad_scale_atol = 0;
  double param_atol = 2e-5;  // < 0: parameters are not compared
  double key_bias_atol = 1e-4;
};

// Each managed gradient shard of `model` against the matching shard of
// `reference`'s gradient times `scale`, in the reference's dtype.
inline void expect_gradients_match(nn::GPT& model, nn::GPT& reference,
                                   const TrainingTolerances& tol = {}, double scale = 1.0) {
  auto ref = reference->named_parameters();
  auto mine = model->named_parameters();
  for (auto& [name, value] : FSDPModule(model.ptr()).state_dict()) {
    const DTensor& d = std::get<DTensor>(value);
    at::Tensor expected = distribute_tensor(ref[name].grad() * scale, d.layout()).local();
    ASSERT_TRUE(mine[name].grad().defined()) << name;
    EXPECT_EQ(mine[name].grad().scalar_type(), expected.scalar_type()) << name;
    const double atol =
        tol.grad_scale_atol > 0
            ? std::max(2e-6, tol.grad_scale_atol * expected.abs().max().item<double>())
            : tol.grad_atol;
    EXPECT_TRUE(tensors_close(mine[name].grad(), expected, tol.grad_rtol, atol)) << name;
  }
}

struct MeshConfig {
  std::string name;  // "fsdp", "hsdp", "ddp"
  std::vector<int64_t> shape;
};

inline DeviceMeshPtr make_mesh(const MeshConfig& config) {
  return init_device_mesh("cpu", config.shape,
                          config.shape.size() == 1 ? std::vector<std::string>{"shard"}
                                                   : std::vector<std::string>{"replicate", "shard"});
}

// Every mode this world size supports.
inline std::vector<MeshConfig> mesh_configs() {
  const int64_t w = dist::get_world_size();
  std::vector<MeshConfig> out = {{"fsdp", {w}}, {"ddp", {w, 1}}};
  if (w == 4) out.push_back({"hsdp", {2, 2}});
  return out;
}

// Blocks first (inner units), then the root. output_dtype applies to the
// root only: blocks hand their outputs to each other in the compute dtype.
inline FSDPModule shard_gpt(nn::GPT& model, FullyShardOptions options) {
  FullyShardOptions block_options = options;
  block_options.mp_policy.output_dtype.reset();
  for (const auto& block : model->blocks()) {
    nn::Block b = block;
    fully_shard(b.ptr(), block_options);
  }
  return fully_shard(model.ptr(), options);
}

inline torch::optim::AdamW make_adamw(nn::Module& model) {
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(1e-2)
                                                      .betas({0.9, 0.95})
                                                      .eps(1e-8)
                                                      .weight_decay(0.1));
}

// Trains a GPT sharded with `options` (shard_gpt) and the single-process
// reference 3 AdamW steps on kBatch rows; compares every step's loss, the
// first step's gradients and the final parameters within `tol`.
inline void expect_training_matches(const FullyShardOptions& options,
                                    const TrainingTolerances& tol = {}) {
  auto reference = make_gpt();
  auto ref_opt = make_adamw(*reference);
  auto model = make_gpt();
  shard_gpt(model, options);
  auto opt = make_adamw(*model);
  for (int step = 0; step < 3; ++step) {
    at::Tensor tokens = token_batch(step, kBatch);
    at::Tensor ref_loss = reference_backward(reference, tokens, dist::get_world_size());
    at::Tensor loss = gpt_loss(model, tokens, my_first_row(), my_rows());
    loss.backward();
    EXPECT_NEAR(world_mean(loss.item<double>()), ref_loss.item<double>(),
                tol.loss_rtol * ref_loss.item<double>())
        << "step " << step;
    if (step == 0) expect_gradients_match(model, reference, tol);
    ref_opt.step();
    ref_opt.zero_grad();
    opt.step();
    opt.zero_grad();
  }
  if (tol.param_atol >= 0) {
    expect_parameters_match(*model, reference, tol.param_atol, tol.key_bias_atol);
  }
}

}  // namespace hp::test
