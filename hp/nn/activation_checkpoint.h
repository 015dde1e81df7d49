// Activation checkpointing (N4 in docs/features.md).
//
// A checkpointed module keeps only its inputs from forward: its forward
// runs without autograd recording anything inside it, and backward runs it
// again, with autograd, on the saved inputs, then back-propagates the
// incoming gradients through that recomputation. Parameter gradients
// accumulate as usual (through the parameters' own gradient accumulators,
// so fully_shard's post-accumulate hooks fire); input gradients flow on to
// the rest of the graph. What stays alive between forward and backward is
// the inputs (as autograd saves them) and the random number generators'
// states; the outputs belong to whoever consumes them (docs/design.md,
// "Activation checkpointing").
//
// Randomness replays: forward records the CPU generator's state (and the
// CUDA generator's of each device an input is on), the recomputation runs
// from those states and puts the generators back as it found them, so
// dropout draws the same masks and the run continues as it would have
// without checkpointing. The gradients equal the run without
// checkpointing bit for bit: the recomputation runs the same kernels on the
// same values, and each gradient sums the same contributions.
//
// A module is recomputed by calling its forward alone, not its hooks: the
// hooks ran once, around the checkpointed call (fully_shard's unit
// gathered for that call; for the recomputation its pre-backward has
// gathered already, see docs/design.md). Submodules are called as in any
// forward, through their holders and hooks.
//
// Like PyTorch's reentrant checkpoint, the recomputation is a backward of
// its own inside the outer one, so a checkpointed graph is backpropagated
// once (no retain_graph); torch::autograd::grad over a checkpointed module
// is not supported.
#pragma once

#include "hp/nn/module.h"

namespace hp::nn {

// Runs `body` on `inputs` under activation checkpointing and returns its
// outputs. Without grad mode it simply runs `body`. `body` must stay valid
// until backward (it is copied) and must compute the same function when
// called again with the same inputs and random states.
TensorList checkpointed(const ForwardBody& body, const TensorList& inputs);

// Makes every call of `module` through its holder (`block(x)`) checkpointed
// (or stops it with enabled = false). The module's hooks run around the
// checkpointed forward as before. Installs the module's forward wrapper
// (module.h); raises hp::ArgumentError if another wrapper is set.
void set_activation_checkpointing(Module& module, bool enabled = true);
bool is_activation_checkpointed(const Module& module);

}  // namespace hp::nn
