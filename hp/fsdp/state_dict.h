// State dicts of sharded models (F14 in docs/features.md).
//
// A state dict is an ordered list of (fully-qualified name, value); a value
// is a plain tensor or a DTensor. fully_shard's state_dict() gives each
// managed parameter as a DTensor of its local shard; get_model_state_dict
// can consolidate them into whole tensors.
#pragma once

#include <string>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/tensor/dtensor.h"

namespace hp {

namespace nn {
class Module;
}

using StateValue = std::variant<at::Tensor, DTensor>;
using StateDict = std::vector<std::pair<std::string, StateValue>>;

struct StateDictOptions {
  // Whole tensors (all-gathered; collective) instead of local DTensors.
  bool full_state_dict = false;
  // Copy values to CPU memory (a GPU model's state dict for a host-side
  // consumer); sharded values stay DTensors of the same layout whose local
  // shards are on the CPU. Values already on the CPU are not copied.
  bool cpu_offload = false;
  // With full_state_dict: only rank 0 keeps the values (all ranks still take
  // part in the gathers); other ranks get an empty state dict. Without
  // full_state_dict it is refused (ArgumentError).
  bool rank0_only = false;
};

// Parameters (managed ones as DTensors, or whole tensors with
// full_state_dict) and buffers of `model`, in module order.
StateDict get_model_state_dict(const nn::Module& model, const StateDictOptions& options = {});

}  // namespace hp
