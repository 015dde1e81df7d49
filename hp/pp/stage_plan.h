// How a model is split into pipeline stages (docs/pipeline.md).
//
// A model is seen as three runs of modules in forward order: a prologue (the
// embeddings), the blocks, an epilogue (the final norm and the head). A stage
// is a contiguous run of them; stage 0 always holds the prologue, the last
// stage the epilogue, and every stage at least one block (a stage without a
// block would only pass its input on, and a plan asking for more stages than
// there are blocks is refused). Module names are the whole model's
// ("h.4", "model.layers.4"), so a stage's parameters keep their whole-model
// names and checkpoints move between pipeline degrees by name.
//
// Plain data, no libtorch: a plan is made and checked before any model or
// process group exists. Errors are hp::ArgumentError naming the argument,
// its value and what was expected.
#pragma once

#include <string>
#include <vector>

namespace hp::nn {
struct GPTConfig;
struct LlamaConfig;
}  // namespace hp::nn

namespace hp::pp {

// A model's modules in forward order.
struct ModelLayout {
  std::vector<std::string> prologue;  // e.g. {"wte", "wpe"}
  std::vector<std::string> blocks;    // e.g. {"h.0", "h.1", ...}
  std::vector<std::string> epilogue;  // e.g. {"ln_f", "lm_head"}
};

ModelLayout gpt_layout(const nn::GPTConfig& config);
ModelLayout llama_layout(const nn::LlamaConfig& config);

struct StagePlan {
  // stages[s]: the module names stage s runs, in forward order.
  std::vector<std::vector<std::string>> stages;

  int num_stages() const { return static_cast<int>(stages.size()); }
  // The stage holding the module that owns `parameter_name` (the longest
  // module name that prefixes it at a dot), or -1.
  int stage_of(const std::string& parameter_name) const;
};

// Splits `layout` into `num_stages` stages.
//   split_points empty: balanced as torchtitan balances an LLM, counting the
//     prologue and the epilogue as one block each: stage loads differ by at
//     most one, earlier stages take the extra (8 blocks over 4 stages gives
//     2, 3, 2, 1 blocks).
//   otherwise: the names of the blocks that begin stages 1, 2, ... in
//     forward order; exactly num_stages - 1 of them (uneven splits allowed).
// Refused: num_stages < 1, more stages than blocks, a split point that names
// no block (the message lists the first and last block), points out of
// order or repeated, a point at the first block (stage 0 would hold no
// block).
StagePlan plan_stages(const ModelLayout& layout, int num_stages,
                      const std::vector<std::string>& split_points = {});

// Checks a plan made by hand against `layout`: every module in exactly one
// stage, stages contiguous and in forward order, each with a block, the
// prologue in stage 0 and the epilogue in the last.
void check_stage_plan(const ModelLayout& layout, const StagePlan& plan);

// "stage 0: wte, wpe, h.0-h.1 | stage 1: h.2-h.4 | ..." for logs and errors.
std::string describe(const StagePlan& plan);

}  // namespace hp::pp
