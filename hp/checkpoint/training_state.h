// What a training job puts in a checkpoint (C1, C5 in docs/features.md):
// the model, AdamW's state and the training position, as State entries.
//
//   hp::checkpoint::State state;
//   hp::checkpoint::add_model(state, *model);                  // "model.<name>"
//   hp::checkpoint::add_adamw(state, optimizer, *model);       // "optim.<name>.exp_avg", ...
//   hp::checkpoint::add_int(state, "train.step", step);        // written back by load()
//   hp::checkpoint::save(state, dir, step);
//
// Build the state right before each save or load: values outside tensors
// (step counts) are copied into it when it is built.
#pragma once

#include <cstdint>
#include <string>

#include "hp/checkpoint/state.h"

namespace torch::optim {
class AdamW;
}

namespace hp {
namespace nn {
class Module;
}

namespace checkpoint {

// Every parameter and buffer of `model` as `prefix` + its name: a parameter
// fully_shard manages as its local shard and layout (its DTensor), any other
// (a one-process or plain model's; a tensor-parallel model's DTensor-valued
// parameters will add their own layouts) whole on every rank. load() writes
// the parameters themselves, so the model and an optimizer built on it see
// the loaded values.
void add_model(State& state, const nn::Module& model, const std::string& prefix = "model.");

// AdamW's state of every parameter of `model` (the optimizer must have been
// built from these parameters): `prefix` + name + ".exp_avg", ".exp_avg_sq"
// (and ".max_exp_avg_sq" with amsgrad), laid out like the parameter, and
// ".step", whole. A parameter without state yet (before the first step) is
// given AdamW's initial state (step 0, zeros), which steps exactly as the
// state AdamW would create, so a fresh optimizer can be loaded into.
void add_adamw(State& state, torch::optim::AdamW& optimizer, const nn::Module& model,
               const std::string& prefix = "optim.");

// An integer (a step, a data position) as a 0-d int64 tensor `key`, whole on
// every rank; load() writes the loaded value back into `value`, which must
// outlive the state.
void add_int(State& state, const std::string& key, int64_t& value);

// The default CPU generator's state as `key` (rank 0's is saved; load()
// sets every rank's generator to it).
void add_cpu_rng(State& state, const std::string& key);

}  // namespace checkpoint
}  // namespace hp
