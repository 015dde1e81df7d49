// Deferred initialisation (F17 in docs/features.md): build the model on
// the meta device, shard it, then give each rank memory for its shards only
// and initialise them, so that no rank ever holds the whole model.
//
//   torch::manual_seed(seed);                          // the same on every rank
//   hp::nn::GPT model(config, at::kMeta);              // meta_device.h: no weights
//   for (auto& block : model->blocks()) hp::fully_shard(block.ptr());
//   hp::fully_shard(model.ptr());                      // shards stay meta
//   hp::init_sharded(*model, model->init_plan());      // the eager model's values
//   // or: hp::checkpoint::load_into_shards(*model, "gpt2.safetensors");
//   torch::optim::AdamW optimizer(model->parameters(), options);   // after
//
// fully_shard and shard_module over meta parameters allocate nothing: the
// shards (and a tensor-parallel DTensor's local shard) are meta tensors of
// their shapes. Training with anything still on meta raises at the first
// forward, naming it and these calls.
//
// Tensors are replaced, not filled in place, where they were plain meta
// tensors (libtorch cannot point a meta tensor at memory): build the
// optimizer after materialising. Both calls are local (no collectives):
// each rank computes only its own pieces.
//
// Generators. init_sharded draws each tensor whole on the CPU with the
// default CPU generator, exactly as the eager model's constructor does, and
// keeps this rank's piece: bit-equal to the eager model, at the price of
// every rank drawing every tensor (compute, not memory: the peak is one
// tensor). With a counter-based generator (CUDA's Philox) each rank could
// instead draw only its slice by advancing the generator's offset, as
// PyTorch's DTensor random ops do; the values would then be those of that
// scheme, not those of an eager CPU init, and torch's CUDA normal_ maps
// offsets to elements by its launch configuration, so a slice's offset is
// not simply its element index. That is not implemented here.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

#include "hp/nn/init_plan.h"
#include "hp/nn/module.h"

namespace hp {

// Allocates every parameter and buffer of `model`'s tree still on the meta
// device, uninitialised, where it will live: a fully_shard-managed
// parameter gets only its shard (padding zeroed) on its unit's device (the
// host when offloaded); a tensor-parallel DTensor parameter its local shard
// on its mesh's device; any other tensor the whole of it on `device`
// (default: the device of the model's first unit or DTensor mesh, else the
// CPU). Tensors not on meta are left alone. Returns the names materialised
// (named_parameters() then named_buffers() order). As FSDP2's to_empty.
std::vector<std::string> to_empty(nn::Module& model,
                                  std::optional<c10::Device> device = std::nullopt);

// to_empty, then runs `plan`'s steps in order, each on a whole scratch tensor
// on the CPU (the tensor's global shape and dtype), keeping this rank's
// piece and freeing the rest before the next step. The values equal those
// nn::apply_init_plan gives the unsharded model from the same generator
// state, bit for bit. Checked before anything changes (ArgumentError): every
// step names a parameter or buffer of `model`, and every tensor on meta is
// named by some step (else it would stay uninitialised; the message lists
// them).
void init_sharded(nn::Module& model, const nn::InitPlan& plan,
                  std::optional<c10::Device> device = std::nullopt);

}  // namespace hp
