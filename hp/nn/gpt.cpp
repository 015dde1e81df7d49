#include "hp/nn/gpt.h"

#include <torch/torch.h>

#include <cmath>
#include <optional>

#include "hp/nn/linear.h"
#include "hp/nn/meta_device.h"
#include "hp/nn/sample_tokens.h"
#include "hp/util/error.h"
#include "hp/util/host_memory.h"

namespace hp::nn {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

GPTImpl::GPTImpl(GPTConfig config, c10::Device device) : Module("GPT"), config_(config) {
  config_.validate();
  HP_CHECK_ARG(device.is_cpu() || device.is_meta(), "GPT: device ", device,
               " must be cpu or meta; build on the CPU and move the model with ->to(", device,
               ")");
  const bool meta = device.is_meta();
  // On meta each submodule leaves the CPU before the next is built.
  auto place = [meta](torch::nn::Module& m) {
    if (meta) move_to_meta(m);
  };
  // Each submodule's weights are drawn on the host and dropped: mapped on
  // their own, they leave no holes in the heap (hp/util/host_memory.h).
  std::optional<ScopedMappedHostBlocks> mapped;
  if (device.is_meta()) mapped.emplace();
  const int64_t d = config_.n_embd;
  wte = register_module("wte", torch::nn::Embedding(config_.vocab_size, d));
  place(*wte);
  wpe = register_module("wpe", torch::nn::Embedding(config_.context, d));
  place(*wpe);
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < config_.n_layer; ++i) {
    blocks_.emplace_back(config_);
    place(*blocks_.back());
    h->push_back(blocks_.back().ptr());
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}).eps(1e-5)));
  place(*ln_f);
  lm_head = register_module(
      "lm_head", torch::nn::Linear(torch::nn::LinearOptions(d, config_.vocab_size).bias(false)));
  place(*lm_head);
  if (!meta) apply_init_plan(*this, init_plan());
}

// nanoGPT's _init_weights applied over modules() in pre-order, then its
// c_proj re-draw over named_parameters(): the same draws in the same order,
// so a seed means the same weights here and in PyTorch. LayerNorm keeps its
// constructor's 1 and 0 in nanoGPT; the steps say so for a meta model.
InitPlan GPTImpl::init_plan() const {
  InitPlan plan;
  for (const auto& item : named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    const std::string& name = item.key();
    const auto& m = item.value();
    if (auto* linear = m->as<torch::nn::Linear>()) {
      plan.push_back(normal_step(name + ".weight", 0.0, 0.02));
      if (linear->bias.defined()) plan.push_back(fill_step(name + ".bias", 0.0));
    } else if (m->as<torch::nn::Embedding>()) {
      plan.push_back(normal_step(name + ".weight", 0.0, 0.02));
    } else if (m->as<torch::nn::LayerNorm>()) {
      plan.push_back(fill_step(name + ".weight", 1.0));
      plan.push_back(fill_step(name + ".bias", 0.0));
    }
  }
  // Residual projections: their outputs add up over 2 * n_layer sub-layers.
  const double proj_std = 0.02 / std::sqrt(2.0 * double(config_.n_layer));
  for (const auto& p : named_parameters()) {
    if (ends_with(p.key(), "c_proj.weight")) plan.push_back(normal_step(p.key(), 0.0, proj_std));
  }
  return plan;
}

at::Tensor GPTImpl::forward(const at::Tensor& idx) {
  HP_CHECK_ARG(idx.scalar_type() == at::kLong && idx.dim() == 2,
               "GPT.forward: idx must be an int64 [B, T] tensor but got ", idx.scalar_type(),
               " of shape ", idx.sizes());
  const int64_t T = idx.size(1);
  HP_CHECK_ARG(T >= 1, "GPT.forward: sequence length ", T, " must be at least 1");
  HP_CHECK_ARG(T <= config_.context, "GPT.forward: sequence length ", T, " exceeds config.context ",
               config_.context);
  // Checked on the host only where that is free: on a GPU reading the ids
  // back would stall the CPU every step, and the embedding's device-side
  // assert stops an out-of-range id there.
  if (idx.is_cpu() && idx.numel() > 0) {
    auto [lo, hi] = torch::aminmax(idx);
    const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
    HP_CHECK_ARG(min_id >= 0 && max_id < config_.vocab_size,
                 "GPT.forward: token ids must be in [0, ", config_.vocab_size, ") but got ",
                 (min_id < 0 ? min_id : max_id));
  }

  at::Tensor x = wte(idx) + wpe(torch::arange(T, idx.options()));
  if (config_.dropout > 0 && is_training()) x = torch::dropout(x, config_.dropout, /*train=*/true);
  for (auto& block : blocks_) x = block(x);
  return linear(lm_head, ln_f(x));
}

at::Tensor GPTImpl::generate(at::Tensor idx, int64_t max_new_tokens, double temperature,
                             int64_t top_k, at::Generator generator) {
  // Through the hooks: a sharded root gathers its parameters here as in training.
  return sample_tokens([this](const at::Tensor& ids) { return call(*this, ids); },
                       config_.context, std::move(idx), max_new_tokens, temperature, top_k,
                       std::move(generator), "GPT.generate");
}

}  // namespace hp::nn
