#include "hp/checkpoint/load_into_shards.h"

#include <filesystem>

#include "hp/checkpoint/consolidated.h"
#include "hp/checkpoint/training_state.h"
#include "hp/fsdp/materialize.h"
#include "hp/nn/module.h"

namespace hp::checkpoint {

LoadResult load_into_shards(nn::Module& model, const std::string& path,
                            const LoadIntoShardsOptions& options) {
  to_empty(model, options.device);
  State state;
  if (std::filesystem::is_directory(path)) {
    add_model(state, model, options.checkpoint_prefix);
    LoadOptions load_options;
    load_options.strict = false;
    return load(state, path, load_options);
  }
  add_model(state, model, "");
  return import_consolidated(state, path, "", options.strict);
}

}  // namespace hp::checkpoint
