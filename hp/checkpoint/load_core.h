// The core of every load (checkpoint.h's load and the import of a
// consolidated file): fills `state` from the chunks `metadata` lists, in
// files under `dir`. Every state key starts with `prefix`, and the key
// without it names the metadata's tensor. `source` starts error messages
// ("checkpoint ckpt/step-00000100"). Collective, agreed as load() says.
#pragma once

#include <string>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/metadata.h"

namespace hp::checkpoint {

LoadResult load_from_metadata(State& state, const Metadata& metadata, const std::string& dir,
                              const std::string& source, const std::string& prefix, bool strict);

}  // namespace hp::checkpoint
