#include "tools/hp_train/parallelize.h"

#include <torch/torch.h>

#include "hp/mesh/device_mesh.h"

namespace hp::train {

std::optional<FSDPModule> parallelize(nn::GPT& model, const Parallelism& parallelism) {
  if (parallelism.mode == Mode::kNone) return std::nullopt;
  FullyShardOptions options;
  options.mesh = init_device_mesh("cpu", parallelism.mesh_shape, parallelism.mesh_names);
  for (const nn::Block& block : model->blocks()) fully_shard(block.ptr(), options);
  return fully_shard(model.ptr(), options);
}

}  // namespace hp::train
