// --init-from: start training from given weights instead of the random initialisation.
//
// The file holds the whole model, as one process would save it (e.g. a
// PyTorch GPT-2 state dict written with safetensors). Under --init eager it
// is loaded into the model before fully_shard, so each rank then keeps only
// its shard of it; under --init meta (F17) only its header is checked here
// and each rank reads its shards' bytes after sharding
// (hp::checkpoint::load_into_shards). Either way every problem of the file
// surfaces before any collective.
#pragma once

#include <string>

namespace torch::nn {
class Module;
}

namespace hp::train {

// Copies every tensor of the safetensors file `path` into the parameter of
// `model` with the same name, converting a floating dtype to the parameter's.
// The file must hold exactly the model's parameters with their shapes:
// otherwise throws hp::ArgumentError naming the file and every offending
// tensor (missing, unexpected, wrong shape or non-floating dtype) with what
// was expected and what the file has. An unreadable or malformed file
// raises hp::ArgumentError with the reader's message (which names the file),
// as does a file whose tensors do not fit in memory. The names, shapes and
// dtypes are checked from the header before any tensor's data is read, and
// nothing is copied unless everything matches.
void load_initial_weights(torch::nn::Module& model, const std::string& path);

// The same checks from the file's header alone (nothing is read or copied),
// for a model on the meta device; the dtypes must also be the parameters'
// own (a load into shards does not convert).
void check_initial_weights(const torch::nn::Module& model, const std::string& path);

}  // namespace hp::train
