// A model's initialisation as an ordered list of per-tensor steps (N6 in
// docs/features.md).
//
// Each step names one parameter or buffer (as named_parameters() /
// named_buffers() name it) and fills the whole tensor in place, drawing from
// the default generator like any eager init. Running the steps in order on
// the model's own tensors (apply_init_plan) is the eager initialisation; a
// tensor may appear in several steps (GPT-2 redraws its residual
// projections). Because a step sees one whole tensor, deferred
// initialisation (hp/fsdp/materialize.h) can run the same steps one tensor at
// a time into a scratch tensor, keep a shard of it and free it: the same
// draws in the same order, so the same values as the eager model, bit for
// bit, with one tensor's memory instead of the model's.
//
// The steps must be deterministic functions of the default generator's
// state and the tensor's shape and dtype (no reading of other tensors): a
// step may run on a scratch tensor, not on the model's.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace hp::nn {

struct InitStep {
  std::string name;                          // "h.0.attn.c_proj.weight"
  std::function<void(at::Tensor&)> fill;     // fills the whole tensor in place
};
using InitPlan = std::vector<InitStep>;

// Runs `plan` in order on `module`'s parameters and buffers, without
// autograd. Throws hp::ArgumentError, before any step runs, naming a step
// whose name is no parameter or buffer of `module`.
void apply_init_plan(torch::nn::Module& module, const InitPlan& plan);

// Common steps.
InitStep normal_step(std::string name, double mean, double std);
InitStep fill_step(std::string name, double value);

}  // namespace hp::nn
