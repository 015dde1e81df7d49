// hp-train's model (--model gpt|llama, A1 in docs/features.md) behind one
// interface, so that the trainer, parallelize, the checkpoints and sampling
// exist once for every model.
//
// A TrainModel is a handle: copies share the module (as torch holders do).
// Not thread-safe beyond what the module itself is.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/init_plan.h"
#include "hp/nn/llama.h"
#include "hp/nn/module.h"
#include "hp/pp/stage_module.h"
#include "hp/pp/stage_plan.h"
#include "hp/tp/sharding_plan.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {

// The configs --model's flags give (--layers, --d, --heads, --ctx, and
// --kv-heads for a Llama) with vocabulary `vocab_size`; the memory plan
// (dry_run.cpp) plans the same model.
nn::GPTConfig gpt_config(const TrainOptions& options, int64_t vocab_size);
nn::LlamaConfig llama_config(const TrainOptions& options, int64_t vocab_size);

class TrainModel {
 public:
  // The model --model names, shaped by --layers, --d, --heads, --ctx (and
  // --kv-heads for a Llama) with vocabulary `vocab_size`, initialised from
  // the current torch seed, on the CPU or on the meta device (`device`,
  // hp/nn/meta_device.h). Throws hp::ArgumentError for an unknown model.
  static TrainModel build(const TrainOptions& options, int64_t vocab_size,
                          c10::Device device = c10::Device(c10::DeviceType::CPU));

  // Implicit: a GPT or Llama holder is a TrainModel sharing its module.
  TrainModel(nn::GPT gpt) : model_(std::move(gpt)) {}        // NOLINT(runtime/explicit)
  TrainModel(nn::Llama llama) : model_(std::move(llama)) {}  // NOLINT(runtime/explicit)

  // The root module: parameters, state dicts, the root fully_shard unit.
  std::shared_ptr<nn::Module> root() const;
  nn::Module& module() const { return *root(); }
  // The transformer blocks (fully_shard units, activation checkpointing),
  // in forward order.
  std::vector<std::shared_ptr<nn::Module>> blocks() const;
  // Parameters of the embedding tables (GPT: tokens and positions; Llama:
  // tokens), a lookup rather than a matmul: model_flops.h leaves them out.
  int64_t embedding_parameter_count() const;
  int64_t vocab_size() const;
  int64_t context() const;
  // The model's initialisation as per-tensor steps (hp/nn/init_plan.h).
  nn::InitPlan init_plan() const;
  // "GPT" or "Llama".
  const char* name() const;

  // ids int64 [B, T] -> logits [B, T, vocab], through the root's hooks.
  at::Tensor operator()(const at::Tensor& idx) const;
  // The model's generate() (hp/nn/gpt.h, hp/nn/llama.h).
  at::Tensor generate(const at::Tensor& prompt, int64_t max_new_tokens, double temperature,
                      int64_t top_k, at::Generator generator) const;
  // The model's tensor-parallel plan (hp/tp/gpt_plan.h, hp/tp/llama_plan.h).
  ShardingPlan tensor_parallel_plan(const DeviceMesh& mesh, const std::string& tp_dim) const;
  // Its modules in forward order, for a pipeline's stage plan
  // (hp/pp/stage_plan.h), and stage `stage` of `plan` over this model's
  // modules (shared, hp/pp/stage_module.h).
  pp::ModelLayout layout() const;
  pp::StageModule stage(const pp::StagePlan& plan, int stage) const;
  // A plain model of the same config holding the global values of this
  // one's parameters (DTensors gathered: collective under tensor
  // parallelism).
  TrainModel whole_copy() const;

 private:
  std::variant<nn::GPT, nn::Llama> model_;
};

}  // namespace hp::train
