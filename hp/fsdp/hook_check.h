// Units that nothing calls through their hooks (N1, F15 in docs/features.md).
//
// A unit gathers its parameters in its module's forward pre-hook, which
// runs only when the module is called through its holder (`block(x)`), an
// hp::nn::Sequential or an hp::nn::Hooked wrapper. Called any other way
// (`block->forward(x)`, from torch::nn::Sequential) its forward computes on
// the shards, silently. These checks turn that into an ArgumentError that
// names the module and what to do instead:
//   statically, in fully_shard before anything changes or is communicated:
//     a unit in the tree whose parent is a torch::nn::Sequential (which
//     calls its modules' forward directly);
//   at the first forward of a root that a backward follows: a unit of the
//     tree whose pre-hook did not run in that forward although its
//     parameters are in the forward's autograd graph (one walk of the
//     graph, that forward only).
// A model none of whose units is ever called through hooks cannot be seen
// by either (no hook runs at all): calling the root through its holder is
// the user's part.
#pragma once

#include <memory>
#include <vector>

#include "hp/nn/module.h"

namespace hp::fsdp {

class Unit;

// The static check over the trees of `roots` (about to become a unit).
void check_units_called_through_hooks(const std::vector<std::shared_ptr<nn::Module>>& roots);

// The dynamic check: `units` are the tree's units, `ran` those whose
// pre-forward ran in the root's forward that produced `outputs`.
void check_units_ran(const std::vector<std::shared_ptr<nn::Module>>& root_modules,
                     const std::vector<std::shared_ptr<Unit>>& units,
                     const std::vector<const Unit*>& ran, const nn::TensorList& outputs);

}  // namespace hp::fsdp
