#include "hp/nn/llama.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <mutex>
#include <optional>

#include "hp/nn/linear.h"
#include "hp/nn/meta_device.h"
#include "hp/nn/sample_tokens.h"
#include "hp/util/error.h"
#include "hp/util/host_memory.h"

namespace hp::nn {

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config, c10::Device device)
    : Module("LlamaModel") {
  config.validate();
  // On meta each submodule leaves the CPU before the next is built.
  auto place = [meta = device.is_meta()](torch::nn::Module& m) {
    if (meta) move_to_meta(m);
  };
  // Each submodule's weights are drawn on the host and dropped: mapped on
  // their own, they leave no holes in the heap (hp/util/host_memory.h).
  std::optional<ScopedMappedHostBlocks> mapped;
  if (device.is_meta()) mapped.emplace();
  embed_tokens =
      register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.n_embd));
  place(*embed_tokens);
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.n_layer; ++i) {
    layer_list_.emplace_back(config);
    place(*layer_list_.back());
    layers->push_back(layer_list_.back().ptr());
  }
  norm = register_module("norm", RMSNorm(config.n_embd, config.rms_norm_eps));
  place(*norm);
}

at::Tensor LlamaModelImpl::forward(const at::Tensor& idx) {
  at::Tensor x = embed_tokens(idx);
  for (auto& layer : layer_list_) x = layer(x);
  return norm(x);
}

void init_llama_parameter(const LlamaConfig& config, const std::string& name,
                          const at::Tensor& value) {
  HP_CHECK_ARG(value.dim() == 1 || value.dim() == 2, "init_llama_parameter: parameter '", name,
               "' of shape ", value.sizes(), " must be 1-D (a norm) or 2-D (a weight)");
  torch::NoGradGuard no_grad;
  if (value.dim() == 1) {
    value.fill_(1.0);
  } else {
    value.normal_(0.0, config.initializer_range);
  }
}

LlamaImpl::LlamaImpl(LlamaConfig config, c10::Device device)
    : Module("Llama"), config_(config) {
  config_.validate();
  HP_CHECK_ARG(device.is_cpu() || device.is_meta(), "Llama: device ", device,
               " must be cpu or meta; build on the CPU and move the model with ->to(", device,
               ")");
  const bool meta = device.is_meta();
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  at::Tensor before;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    before = generator.get_state();
  }
  model = register_module("model", LlamaModel(config_, device));
  lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(
                                           config_.n_embd, config_.vocab_size)
                                           .bias(false)));
  if (meta) move_to_meta(*lm_head);
  {
    // The modules' own default initialisation is overwritten below; putting
    // the generator back makes the weights depend only on the generator's
    // state before construction and the parameter order (see the header).
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(before);
  }
  if (!meta) apply_init_plan(*this, init_plan());
}

InitPlan LlamaImpl::init_plan() const {
  InitPlan plan;
  for (const auto& p : named_parameters()) {
    plan.push_back({p.key(), [config = config_, name = p.key()](at::Tensor& value) {
                      init_llama_parameter(config, name, value);
                    }});
  }
  return plan;
}

at::Tensor LlamaImpl::forward(const at::Tensor& idx) {
  HP_CHECK_ARG(idx.scalar_type() == at::kLong && idx.dim() == 2,
               "Llama.forward: idx must be an int64 [B, T] tensor but got ", idx.scalar_type(),
               " of shape ", idx.sizes());
  const int64_t T = idx.size(1);
  HP_CHECK_ARG(T >= 1, "Llama.forward: sequence length ", T, " must be at least 1");
  HP_CHECK_ARG(T <= config_.context, "Llama.forward: sequence length ", T,
               " exceeds config.context ", config_.context);
  // Checked on the host only where that is free (as GPT::forward).
  if (idx.is_cpu() && idx.numel() > 0) {
    auto minmax = torch::aminmax(idx);
    const int64_t min_id = std::get<0>(minmax).item<int64_t>();
    const int64_t max_id = std::get<1>(minmax).item<int64_t>();
    HP_CHECK_ARG(min_id >= 0 && max_id < config_.vocab_size,
                 "Llama.forward: token ids must be in [0, ", config_.vocab_size, ") but got ",
                 (min_id < 0 ? min_id : max_id));
  }
  return linear(lm_head, model(idx));
}

at::Tensor LlamaImpl::generate(at::Tensor idx, int64_t max_new_tokens, double temperature,
                               int64_t top_k, at::Generator generator) {
  return sample_tokens([this](const at::Tensor& ids) { return call(*this, ids); },
                       config_.context, std::move(idx), max_new_tokens, temperature, top_k,
                       std::move(generator), "Llama.generate");
}

}  // namespace hp::nn
