// fully_shard parity on a toy model: FSDP, HSDP and DDP on
// real processes, 3 AdamW steps, against the same model trained on the
// same global batch in this process. Also the lifecycle facts the design rests
// on: parameters keep their identity, hold their shard between steps, and
// a unit's gathered memory is released after forward.
//
// The reference processes the global batch as the ranks' slices and averages
// their gradients (the arithmetic data parallelism does); each step starts
// both from the reference's parameters. Tolerances are derived, none is a
// constant: losses and gradients within the reordering bound of the terms
// the reference recorded, parameters after AdamW within AdamWBound of those
// (tests/fsdp/data_parallel_reference.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/shard_spec.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

struct Config {
  std::string name;
  std::vector<int64_t> mesh_shape;
  bool reshard_after_forward;
};

std::vector<Config> configs() {
  const int64_t w = dist::get_world_size();
  std::vector<Config> out;
  for (bool raf : {true, false}) {
    out.push_back({"fsdp", {w}, raf});
    out.push_back({"ddp", {w, 1}, raf});
    if (w == 4) out.push_back({"hsdp", {2, 2}, raf});
  }
  return out;
}

// AdamWOptions' defaults but for lr, betas and weight decay.
test::AdamWHyper adamw_hyper() { return {1e-2, 0.9, 0.95, 1e-8, 0.1}; }

torch::optim::AdamW make_optimizer(nn::Module& model) {
  const test::AdamWHyper h = adamw_hyper();
  return torch::optim::AdamW(model.parameters(), torch::optim::AdamWOptions(h.lr)
                                                     .betas({h.beta1, h.beta2})
                                                     .eps(h.eps)
                                                     .weight_decay(h.weight_decay));
}

test::ToyModel shard(const Config& config, FSDPModule* root_handle = nullptr) {
  auto model = test::make_toy_model();
  FullyShardOptions options;
  options.mesh = test::data_parallel_mesh(config.mesh_shape);
  options.reshard_after_forward = config.reshard_after_forward;
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  if (root_handle) *root_handle = root;
  return model;
}

TEST(FullyShardParity, ThreeAdamWStepsMatchOneProcess) {
  for (const Config& config : configs()) {
    SCOPED_TRACE(config.name + (config.reshard_after_forward ? " reshard" : " keep"));
    auto reference = test::make_toy_model();
    auto ref_opt = make_optimizer(*reference);
    auto model = shard(config);
    auto opt = make_optimizer(*model);
    test::AdamWBound adam(adamw_hyper());
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      test::copy_parameters(model, reference);
      auto [x, y] = test::global_batch(step);
      // Loss and each rank's gradient shards against the reference's.
      auto bounds = test::expect_mse_step_matches(model, reference, x, y);
      test::step_and_expect_parameters_match(model, reference, opt, ref_opt, adam, bounds);
    }
  }
}

TEST(FullyShardLifecycle, ParametersKeepIdentityAndHoldShards) {
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  auto fresh = test::make_toy_model();
  std::vector<const c10::TensorImpl*> impls;
  std::map<std::string, std::vector<int64_t>> full_shapes;
  for (auto& item : fresh->named_parameters()) {
    impls.push_back(item.value().unsafeGetTensorImpl());
    full_shapes[item.key()] = item.value().sizes().vec();
  }
  for (auto& block : fresh->block_list) fully_shard(block.ptr());
  fully_shard(fresh.ptr());
  // The same TensorImpls (an optimizer built before or after sees the same
  // parameters), now holding the torch.chunk piece of dim 0.
  std::vector<const c10::TensorImpl*> after;
  for (auto& item : fresh->named_parameters()) {
    after.push_back(item.value().unsafeGetTensorImpl());
    std::vector<int64_t> expected = full_shapes.at(item.key());
    expected[0] = chunk_span(expected[0], world, rank).size;
    EXPECT_EQ(item.value().sizes().vec(), expected) << item.key();
  }
  EXPECT_EQ(impls, after);

  // After forward: block units released their gathered memory (full shape,
  // no storage); the root keeps its parameters gathered for backward.
  auto [x, y] = test::global_batch(0);
  at::Tensor loss = torch::mse_loss(fresh(test::rows_for(x, rank, world)),
                                    test::rows_for(y, rank, world));
  if (world > 1) {
    const at::Tensor& w1 = fresh->block_list[0]->fc1->weight;
    EXPECT_EQ(w1.sizes().vec(), (std::vector<int64_t>{14, 10}));
    EXPECT_FALSE(fsdp::storage_is_allocated(w1));
    const at::Tensor& head = fresh->head->weight;
    EXPECT_EQ(head.sizes().vec(), (std::vector<int64_t>{5, 10}));
    EXPECT_TRUE(fsdp::storage_is_allocated(head));
  }
  loss.backward();
  for (auto& item : fresh->named_parameters()) {
    EXPECT_EQ(item.value().grad().sizes(), item.value().sizes()) << item.key();
    EXPECT_TRUE(fsdp::storage_is_allocated(item.value())) << item.key();
  }
}

}  // namespace
}  // namespace hp
