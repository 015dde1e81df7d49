// Loading weights straight into a sharded model (C6 in docs/features.md):
// the checkpoint half of deferred initialisation (hp/fsdp/materialize.h).
//
//   hp::nn::GPT model(config, at::kMeta);
//   ... fully_shard / shard_module ...
//   hp::checkpoint::load_into_shards(*model, "gpt2.safetensors");   // or a checkpoint dir
//
// Each rank allocates only its shards (to_empty) and reads only what they
// hold: from a consolidated safetensors file (whole tensors by parameter
// name, e.g. written by PyTorch or export_consolidated) the byte ranges of
// its own pieces (a dim-0 shard is one contiguous range; LoadResult's
// bytes_read counts them); from a project checkpoint (checkpoint.h, saved
// on any mesh or world size) the saved chunks its pieces overlap.
//
// A pipeline stage (hp/pp/stage_module.h) loads by its whole-model names.
// In one process this call takes it: a checkpoint directory's other
// stages' keys are ignored, a consolidated file's need strict = false.
// On the ranks of a pipeline, whose stages differ, use load_into_stages
// (hp/pp/pipeline_checkpoint.h), which declares the other stages' keys so that the
// ranks' states agree.
#pragma once

#include <optional>
#include <string>

#include <c10/core/Device.h>

#include "hp/checkpoint/checkpoint.h"

namespace hp {
namespace nn {
class Module;
}
namespace checkpoint {

struct LoadIntoShardsOptions {
  // The model's keys in a checkpoint directory (hp-train saves "model.");
  // a safetensors file names the tensors as the model does.
  std::string checkpoint_prefix = "model.";
  // A tensor of the safetensors file the model lacks is an error. (A
  // checkpoint directory holds more than the model, the optimizer's state:
  // its other keys are ignored.)
  bool strict = true;
  // Where tensors outside units and meshes go (to_empty's `device`).
  std::optional<c10::Device> device;
};

// to_empty(model), then fills every parameter and buffer of `model` from
// `path`: a safetensors file (import_consolidated), or a checkpoint
// directory or root (load(): the newest complete checkpoint under a root).
// Collective over every rank of the job, with load()'s checks and errors;
// a failure leaves the model materialised but not (or partly) loaded.
LoadResult load_into_shards(nn::Module& model, const std::string& path,
                            const LoadIntoShardsOptions& options = {});

}  // namespace checkpoint
}  // namespace hp
