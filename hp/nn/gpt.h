// A GPT-2 language model (N2, N3 in docs/features.md).
//
// Parameter names are GPT-2's, so weights exchange with PyTorch by name:
//   wte.weight [vocab, d], wpe.weight [context, d], h.<i>.{ln_1, attn.c_attn,
//   attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}.{weight, bias}, ln_f.{weight,
//   bias}, lm_head.weight [vocab, d] (no bias, not tied to wte).
// named_parameters() yields exactly these, in that order, and the module has
// no buffers, so state_dict is the same set.
//
// Initialisation (GPT-2 / nanoGPT) is a function of torch::manual_seed only:
// Linear and Embedding weights ~ N(0, 0.02), biases 0, LayerNorm 1 and 0,
// then every c_proj.weight redrawn ~ N(0, 0.02 / sqrt(2 n_layer)). The draws
// happen in the order nanoGPT makes them, so the same seed gives the same
// weights as tests/nn/gpt_reference.py. init_plan() is that initialisation
// as per-tensor steps (init_plan.h): the eager constructor runs them, and
// deferred initialisation runs the same steps into the shards.
//
// Built with device at::kMeta, the model holds meta tensors (meta_device.h):
// each submodule is constructed (its constructor's draws as in the eager
// model) and moved to meta before the next, so the peak is one submodule,
// and the init steps are not run; hp::init_sharded(model, model->init_plan())
// after fully_shard then gives each rank the eager model's shards.
//
// Blocks are called through their holders (and generate() calls forward
// through this module's own hooks), so hooks registered by fully_shard on the
// blocks and the root run.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <vector>

#include "hp/nn/block.h"
#include "hp/nn/gpt_config.h"
#include "hp/nn/init_plan.h"
#include "hp/nn/module.h"

namespace hp::nn {

class GPTImpl : public Module {
 public:
  // Throws hp::ArgumentError when config.validate() does, or for a device
  // other than the CPU or meta (move a CPU-built model with ->to(device)).
  explicit GPTImpl(GPTConfig config, c10::Device device = c10::Device(c10::DeviceType::CPU));

  // idx: int64 [B, T], 1 <= T <= config.context, ids in [0, vocab_size)
  // -> logits [B, T, vocab_size]. Ids out of range raise ArgumentError on
  // the CPU; on a GPU the embedding's device-side assert stops them (a host
  // check would sync every step).
  at::Tensor forward(const at::Tensor& idx);

  // Appends max_new_tokens sampled tokens to idx [B, T0] and returns
  // [B, T0 + max_new_tokens]. Each step feeds the last config.context tokens,
  // divides the last position's logits by temperature (> 0), keeps the top_k
  // largest (0 = all) and samples with `generator` (an undefined generator
  // means torch's default one). Runs without autograd, in the module's
  // current mode: call eval() first when dropout is on.
  at::Tensor generate(at::Tensor idx, int64_t max_new_tokens, double temperature, int64_t top_k,
                      at::Generator generator);

  const GPTConfig& config() const { return config_; }
  // The initialisation as ordered per-tensor steps (see above).
  InitPlan init_plan() const;
  // The blocks h.0, h.1, ... in forward order.
  const std::vector<Block>& blocks() const { return blocks_; }

  torch::nn::Embedding wte{nullptr};
  torch::nn::Embedding wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};

 private:
  GPTConfig config_;
  std::vector<Block> blocks_;
};
HP_MODULE(GPT);

}  // namespace hp::nn
