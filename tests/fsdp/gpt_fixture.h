// A small GPT (2 layers, d 64) for fully_shard tests, its data and the
// sharding recipe every test uses: each block a unit, then the root.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/support/model_configs.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"

namespace hp::test {

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

// Mean cross-entropy of `model` on rows [first, first + count) of `tokens`.
// `logits_dtype` casts the logits before the loss (a bf16 model's output).
inline at::Tensor gpt_loss(nn::GPT& model, const at::Tensor& tokens, int64_t first,
                           int64_t count, std::optional<at::ScalarType> logits_dtype = {}) {
  at::Tensor rows = tokens.narrow(0, first, count);
  at::Tensor inputs = rows.narrow(1, 0, rows.size(1) - 1);
  at::Tensor targets = rows.narrow(1, 1, rows.size(1) - 1);
  at::Tensor logits = model(inputs);
  if (logits_dtype) logits = logits.to(*logits_dtype);
  return nn::cross_entropy(logits, targets);
}

// The reference step of the GPT (data_parallel_backward): the global batch
// as `parts` equal micro-batches, the data-parallel ranks' slices. With
// `compute_dtype` (mixed precision) each part runs on a copy of the model
// cast to it, logits cast back to the parameters' dtype before the loss,
// its gradients cast back before the sum: what fully_shard's param_dtype
// with the parameters' dtype as reduce_dtype and output_dtype does.
// Returns the mean loss.
inline at::Tensor reference_backward(nn::GPT& model, const at::Tensor& tokens, int64_t parts,
                                     std::optional<at::ScalarType> compute_dtype = {}) {
  std::vector<at::Tensor> params = model->parameters();
  nn::GPT compute = model;
  if (compute_dtype) {
    compute = nn::GPT(model->config());
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> copies = compute->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      copies[i].set_data(params[i].detach().to(*compute_dtype));
    }
  }
  const at::ScalarType dtype = params.at(0).scalar_type();
  const int64_t rows = tokens.size(0) / parts;
  return data_parallel_backward(params, compute->parameters(), parts, [&](int64_t p) {
    return gpt_loss(compute, tokens, p * rows, rows, dtype);
  });
}

struct MeshConfig {
  std::string name;  // "fsdp", "hsdp", "ddp"
  std::vector<int64_t> shape;
};

inline DeviceMeshPtr make_mesh(const MeshConfig& config) {
  return data_parallel_mesh(config.shape);
}

// Every mode this world size supports.
inline std::vector<MeshConfig> mesh_configs() {
  const int64_t w = dist::get_world_size();
  std::vector<MeshConfig> out = {{"fsdp", {w}}, {"ddp", {w, 1}}};
  if (w == 4) out.push_back({"hsdp", {2, 2}});
  return out;
}

// The parameters the comm_fusion + replicate_params cases keep whole: some
// in the root's unit, some in each block's (a weight, biases, a LayerNorm).
inline const std::vector<std::string> kReplicatedGptParams = {
    "wpe.weight", "ln_f.weight", "h.0.attn.c_attn.bias", "h.1.mlp.c_fc.weight", "h.1.ln_2.bias"};

// How the GPT's units reduce: one collective per parameter, or comm_fusion
// with kReplicatedGptParams kept whole (one all-reduce over the mesh per
// unit beside the fused reduce-scatter). Tests that hold for both run both.
struct GptReduction {
  std::string name;
  bool comm_fusion;
  std::vector<std::string> replicated;  // shard_gpt's `replicated`
};
inline std::vector<GptReduction> gpt_reductions() {
  return {{"per parameter", false, {}}, {"fused, replicate_params", true, kReplicatedGptParams}};
}

// Blocks first (inner units), then the root. output_dtype applies to the
// root only: blocks hand their outputs to each other in the compute dtype.
// The parameters named in `replicated` (as model->named_parameters() names
// them) are kept whole: each joins the replicate_params of the unit that
// owns it (block i's "h.<i>." names, the root's the others).
inline FSDPModule shard_gpt(nn::GPT& model, FullyShardOptions options,
                            const std::vector<std::string>& replicated = {}) {
  auto params = model->named_parameters();
  // The named parameters of the block whose names start with
  // `block_prefix`, or with an empty prefix the root's own (outside "h.").
  auto replicated_in = [&](const std::string& block_prefix) {
    std::vector<at::Tensor> out;
    for (const std::string& name : replicated) {
      const bool in_blocks = name.rfind("h.", 0) == 0;
      if (block_prefix.empty() ? !in_blocks : name.rfind(block_prefix, 0) == 0) {
        out.push_back(params[name]);
      }
    }
    return out;
  };
  FullyShardOptions block_options = options;
  block_options.mp_policy.output_dtype.reset();
  const auto blocks = model->blocks();
  for (size_t i = 0; i < blocks.size(); ++i) {
    nn::Block b = blocks[i];
    if (!replicated.empty()) {
      block_options.replicate_params = replicated_in("h." + std::to_string(i) + ".");
    }
    fully_shard(b.ptr(), block_options);
  }
  if (!replicated.empty()) options.replicate_params = replicated_in("");
  return fully_shard(model.ptr(), options);
}

// The AdamW of the training tests, and its hyperparameters for AdamWBound.
inline AdamWHyper adamw_hyper() { return {1e-2, 0.9, 0.95, 1e-8, 0.1}; }

inline torch::optim::AdamW make_adamw(nn::Module& model) {
  const AdamWHyper h = adamw_hyper();
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(h.lr)
                                                      .betas({h.beta1, h.beta2})
                                                      .eps(h.eps)
                                                      .weight_decay(h.weight_decay));
}

// Trains a GPT sharded with `options` (shard_gpt) and the single-process
// reference 3 AdamW steps on kBatch rows. Each step starts from the
// reference's parameters (copied into the shards) and compares the mean
// loss (loss_bound), every gradient shard (expect_gradients_match) and the
// parameters after the step (AdamWBound of those gradient bounds). The
// optimizers keep their own moments across steps, so the sharded optimizer
// state is checked too; what is not carried over is Adam's amplification
// of rounding (its 1/sqrt(v) where v ~ 0), which would feed into the next
// step's gradients beyond any reordering bound. `compute_dtype` is the
// options' mp_policy.param_dtype, when one is set; `replicated` as for
// shard_gpt.
inline void expect_training_matches(const FullyShardOptions& options,
                                    std::optional<at::ScalarType> compute_dtype = {},
                                    const std::vector<std::string>& replicated = {}) {
  auto reference = make_gpt();
  auto ref_opt = make_adamw(*reference);
  auto model = make_gpt();
  shard_gpt(model, options, replicated);
  auto opt = make_adamw(*model);
  AdamWBound adam(adamw_hyper());
  const int64_t parts = dist::get_world_size();
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    copy_parameters(model, reference);
    at::Tensor tokens = token_batch(step, kBatch);
    at::Tensor ref_loss = reference_backward(reference, tokens, parts, compute_dtype);
    at::Tensor loss = gpt_loss(model, tokens, my_first_row(), my_rows());
    loss.backward();
    EXPECT_TRUE(within_bound(world_mean(loss.item<double>()), ref_loss.item<double>(),
                             loss_bound(ref_loss, parts)))
        << "loss";
    auto grad_bounds = expect_gradients_match(model, reference);
    step_and_expect_parameters_match(model, reference, opt, ref_opt, adam, grad_bounds);
  }
}

}  // namespace hp::test
