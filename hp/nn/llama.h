// A Llama-family language model (N5 in docs/features.md): Hugging Face's
// LlamaForCausalLM without biases, caches or rope scaling.
//
// Parameter names are Hugging Face's, so a consolidated safetensors file of
// that layout loads by name:
//   model.embed_tokens.weight [vocab, d],
//   model.layers.<i>.self_attn.{q,k,v,o}_proj.weight,
//   model.layers.<i>.mlp.{gate,up,down}_proj.weight,
//   model.layers.<i>.{input_layernorm, post_attention_layernorm}.weight,
//   model.norm.weight, lm_head.weight [vocab, d] (not tied).
// named_parameters() yields exactly these, in that order, and the module has
// no buffers (the rotary tables and the mask are computed per call), so
// state_dict is the same set.
//
// Initialisation (Hugging Face's _init_weights) is a function of
// torch::manual_seed only: the default CPU generator is put back after the
// modules are built (their own default draws are discarded), then every
// parameter in named_parameters() order is set by init_llama_parameter:
// 2-D ones (Linear and Embedding weights) ~ N(0, initializer_range), 1-D
// ones (RMSNorm weights) 1. So replaying init_llama_parameter over the names
// in that order, from the same seed, gives the same weights, and so does
// tests/nn/llama_reference.py. init_plan() is that initialisation as
// per-tensor steps (init_plan.h).
//
// Built with device at::kMeta, the model holds meta tensors (meta_device.h):
// each submodule is built on the CPU and moved to meta before the next, so
// the peak is one submodule, and the init steps are not run;
// hp::init_sharded(model, model->init_plan()) gives every rank its shards of
// the eager model's values (hp/fsdp/materialize.h).
//
// Decoder layers are called through their holders, so hooks registered by
// fully_shard on them (layers()) and on the root run.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <cstdint>
#include <string>
#include <vector>

#include "hp/nn/llama_config.h"
#include "hp/nn/llama_layer.h"
#include "hp/nn/init_plan.h"
#include "hp/nn/module.h"
#include "hp/nn/rms_norm.h"

namespace hp::nn {

// Hugging Face's LlamaModel: the embedding, the decoder layers and the final
// norm. forward(idx [B, T]) -> hidden states [B, T, n_embd], unchecked (the
// Llama checks its input).
class LlamaModelImpl : public Module {
 public:
  // On at::kMeta each submodule is moved to meta once built.
  explicit LlamaModelImpl(const LlamaConfig& config,
                          c10::Device device = c10::Device(c10::DeviceType::CPU));
  at::Tensor forward(const at::Tensor& idx);

  const std::vector<LlamaDecoderLayer>& layer_list() const { return layer_list_; }

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};

 private:
  std::vector<LlamaDecoderLayer> layer_list_;
};
HP_MODULE(LlamaModel);

class LlamaImpl : public Module {
 public:
  // Throws hp::ArgumentError when config.validate() does, or for a device
  // other than the CPU or meta (move a CPU-built model with ->to(device)).
  explicit LlamaImpl(LlamaConfig config, c10::Device device = c10::Device(c10::DeviceType::CPU));

  // idx: int64 [B, T], 1 <= T <= config.context, ids in [0, vocab_size)
  // -> logits [B, T, vocab_size]. Ids out of range raise ArgumentError on
  // the CPU; on a GPU the embedding's device-side assert stops them.
  at::Tensor forward(const at::Tensor& idx);

  // hp::nn::sample_tokens over this module's forward, called through its
  // hooks (a sharded root gathers its parameters as in training); the same
  // contract as GPT::generate.
  at::Tensor generate(at::Tensor idx, int64_t max_new_tokens, double temperature, int64_t top_k,
                      at::Generator generator);

  const LlamaConfig& config() const { return config_; }
  // The initialisation as steps, one per parameter in named_parameters()
  // order (init_llama_parameter's values).
  InitPlan init_plan() const;
  // The decoder layers model.layers.0, 1, ... in forward order.
  const std::vector<LlamaDecoderLayer>& layers() const { return model->layer_list(); }

  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  LlamaConfig config_;
};
HP_MODULE(Llama);

// Sets the parameter `value` of a Llama of `config` to its initial value,
// drawing from the default CPU generator: ~ N(0, initializer_range) when
// 2-D, 1 when 1-D (`name` is used in the error message only). Throws
// hp::ArgumentError for another rank.
void init_llama_parameter(const LlamaConfig& config, const std::string& name,
                          const at::Tensor& value);

}  // namespace hp::nn
