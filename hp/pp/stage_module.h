// One pipeline stage of a model: the modules its stage plan names, under the
// whole model's names (docs/pipeline.md).
//
//   hp::nn::GPT whole(config, at::kMeta);                 // no weights
//   auto plan = hp::pp::plan_stages(hp::pp::gpt_layout(config), 4);
//   hp::pp::StageModule stage = hp::pp::gpt_stage(*whole, plan, my_stage);
//   auto init = hp::pp::stage_init_plan(*whole, whole->init_plan(), *stage);
//   whole = nullptr;                                       // the rest is dropped
//   ... fully_shard / shard_module on the stage's blocks and the stage ...
//   hp::init_sharded(*stage, init);                        // the whole model's values
//
// The stage shares its modules with `whole` (no copy), so a stage cut from a
// meta model stays meta until init_sharded or load_into_shards materialises
// it, and fully_shard, shard_module and activation checkpointing apply to
// its blocks and to the stage as they do to a whole model.
// named_parameters() gives whole-model names ("h.4.attn.c_attn.weight").
//
// forward(input): stage 0 takes token ids int64 [B, T] and runs the
// embeddings; other stages take the previous stage's hidden states
// [B, T, d]. The last stage returns logits [B, T, vocab], the others hidden
// states. Blocks are called through their holders, so their hooks run.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "hp/nn/init_plan.h"
#include "hp/nn/module.h"
#include "hp/pp/stage_plan.h"

namespace hp::nn {
class GPTImpl;
class LlamaImpl;
}  // namespace hp::nn

namespace hp::pp {

class StageModuleImpl : public nn::Module {
 public:
  using Call = std::function<at::Tensor(const at::Tensor&)>;

  StageModuleImpl(int stage, int num_stages, std::vector<std::string> module_names);

  at::Tensor forward(const at::Tensor& input);

  int stage() const { return stage_; }
  int num_stages() const { return num_stages_; }
  bool is_first() const { return stage_ == 0; }
  bool is_last() const { return stage_ == num_stages_ - 1; }
  // The names of the modules this stage runs, in forward order.
  const std::vector<std::string>& module_names() const { return module_names_; }
  // The stage's blocks in forward order: the units of fully_shard and of
  // activation checkpointing.
  const std::vector<std::shared_ptr<nn::Module>>& blocks() const { return blocks_; }

  // For the model-specific builders (gpt_stage, llama_stage): registers
  // `module` under its whole-model dotted name, making the containers on the
  // way ("h" for "h.4"), and the calls forward makes.
  void adopt(const std::string& dotted_name, std::shared_ptr<torch::nn::Module> module);
  void set_calls(Call prologue, std::vector<std::shared_ptr<nn::Module>> blocks,
                 std::vector<Call> block_calls, Call epilogue);

 private:
  int stage_;
  int num_stages_;
  std::vector<std::string> module_names_;
  Call prologue_;  // stage 0: ids -> hidden
  std::vector<std::shared_ptr<nn::Module>> blocks_;
  std::vector<Call> block_calls_;
  Call epilogue_;  // last stage: hidden -> logits
};
HP_MODULE(StageModule);

// Stage `stage` of `plan` over `whole`'s modules (shared). Throws
// ArgumentError when the plan does not fit the model (check_stage_plan) or
// `stage` is out of range.
StageModule gpt_stage(nn::GPTImpl& whole, const StagePlan& plan, int stage);
StageModule llama_stage(nn::LlamaImpl& whole, const StagePlan& plan, int stage);

// `whole_plan` (the whole model's init plan, e.g. GPT::init_plan()) for the
// stage `stage_module`: the steps of its own tensors, with every step of
// another stage's tensor folded in as a draw into a scratch tensor of that
// tensor's shape (read from `whole`, meta or not) that is then dropped. So
// init_sharded(stage, plan) draws what the whole model's init draws, in the
// same order, and each stage gets the whole model's values bit for bit.
nn::InitPlan stage_init_plan(const torch::nn::Module& whole, const nn::InitPlan& whole_plan,
                             const StageModuleImpl& stage_module);

}  // namespace hp::pp
