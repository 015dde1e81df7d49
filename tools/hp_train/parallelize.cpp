#include "tools/hp_train/parallelize.h"

#include <torch/torch.h>

#include "hp/plan/parallel_layout.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/activation_checkpoint.h"
#include "hp/tp/shard_module.h"

namespace hp::train {

std::optional<FSDPModule> parallelize(TrainModel& model, const Parallelism& parallelism,
                                      const TrainOptions& train) {
  // The checkpointed call runs inside the hooks fully_shard and the
  // tensor-parallel plan install, whichever comes first.
  if (train.activation_checkpointing == "blocks") {
    for (const auto& block : model.blocks()) nn::set_activation_checkpointing(*block);
  }
  using plan::ParallelMode;
  if (parallelism.mode == ParallelMode::kNone) return std::nullopt;
  const std::string device_type = train.device.empty() ? "cpu" : train.device;
  if (!parallelism.uses_fully_shard()) {  // tensor parallelism alone
    auto mesh = init_device_mesh(device_type, parallelism.mesh_shape, parallelism.mesh_names);
    shard_module(model.root(), mesh, model.tensor_parallel_plan(*mesh, "tp"));
    return std::nullopt;
  }
  FullyShardOptions options;
  if (parallelism.tensor_parallel()) {
    // Tensor parallel over mesh["tp"], then fully_shard over mesh["dp"]
    // (of one rank under --mode tp: units that only carry mixed precision).
    auto mesh = init_device_mesh(device_type, {parallelism.dp_size(), parallelism.tp_size()},
                                 {"dp", "tp"});
    auto tp = (*mesh)["tp"];
    shard_module(model.root(), tp, model.tensor_parallel_plan(*tp, "tp"));
    options.mesh = (*mesh)["dp"];
  } else {
    options.mesh = init_device_mesh(device_type, parallelism.mesh_shape, parallelism.mesh_names);
  }
  options.comm_fusion = train.comm_fusion;
  const at::ScalarType param = plan::scalar_type(parallelism.param_dtype);
  if (param != at::kFloat) options.mp_policy.param_dtype = param;
  if (parallelism.reduce_dtype) {
    options.mp_policy.reduce_dtype = plan::scalar_type(*parallelism.reduce_dtype);
  }
  const auto& blocks = model.blocks();
  for (size_t i = 0; i < blocks.size(); ++i) {
    FullyShardOptions block_options = options;
    block_options.reshard_after_forward =
        parallelism.block_reshard_after_forward(static_cast<int64_t>(i),
                                                static_cast<int64_t>(blocks.size()));
    fully_shard(blocks[i], block_options);
  }
  // The loss is computed on the root's output: fp32 logits whatever the
  // compute dtype (blocks pass activations to each other in it).
  if (param != at::kFloat) options.mp_policy.output_dtype = at::kFloat;
  // --reshard-after-forward is for the blocks but the last
  // (ParallelLayout::block_reshard_after_forward): the root keeps its
  // parameters (the default), as its backward follows its forward at once.
  options.reshard_after_forward = std::nullopt;
  FSDPModule root = fully_shard(model.root(), options);
  root.set_implicit_prefetch(train.prefetch);
  return root;
}

std::optional<FSDPModule> parallelize(nn::GPT& model, const Parallelism& parallelism,
                                      const TrainOptions& train) {
  TrainModel shared(model);  // the same module
  return parallelize(shared, parallelism, train);
}

std::vector<FSDPModule> fully_shard_units(TrainModel& model, const FSDPModule& root) {
  std::vector<FSDPModule> units{root};
  for (const auto& block : model.blocks()) units.emplace_back(block);
  return units;
}

}  // namespace hp::train
