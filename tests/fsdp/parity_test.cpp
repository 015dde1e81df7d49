// fully_shard parity on a toy model (F1-F6): FSDP, HSDP and DDP on
// real processes, trained 3 AdamW steps, against the same model trained on
// the whole batch in this process. Also the lifecycle facts the design rests
// on: parameters keep their identity, hold their shard between steps, and
// a unit's gathered memory is released after forward.
//
// Tolerance: fp32 with rtol 1e-5 on losses and gradients (the distributed
// run sums per-rank gradients in another order than one big batch, a few
// ulps); parameters after Adam use atol 1e-5 because Adam divides by
// sqrt(v), which turns ulp-level gradient differences on near-zero
// gradients into slightly larger absolute differences.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/dist/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/storage.h"
#include "hp/tensor/shard_spec.h"
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

torch::optim::AdamW make_optimizer(nn::Module& model) {
  return torch::optim::AdamW(model.parameters(),
                             torch::optim::AdamWOptions(1e-2).betas({0.9, 0.95}).weight_decay(0.1));
}

test::ToyModel shard(const Config& config, FSDPModule* root_handle = nullptr) {
  auto model = test::make_toy_model();
  FullyShardOptions options;
  options.mesh = init_device_mesh("cpu", config.mesh_shape,
                                  config.mesh_shape.size() == 1
                                      ? std::vector<std::string>{"shard"}
                                      : std::vector<std::string>{"replicate", "shard"});
  options.reshard_after_forward = config.reshard_after_forward;
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  if (root_handle) *root_handle = root;
  return model;
}

TEST(FullyShardParity, ThreeAdamWStepsMatchOneProcess) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  for (const Config& config : configs()) {
    SCOPED_TRACE(config.name + (config.reshard_after_forward ? " reshard" : " keep"));
    auto reference = test::make_toy_model();
    auto ref_opt = make_optimizer(*reference);
    auto model = shard(config);
    auto opt = make_optimizer(*model);
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = test::global_batch(step);
      at::Tensor ref_loss = torch::mse_loss(reference(x), y);
      ref_loss.backward();
      at::Tensor loss = torch::mse_loss(model(test::rows_for(x, rank, world)),
                                        test::rows_for(y, rank, world));
      loss.backward();
      EXPECT_NEAR(test::world_mean(loss.item<double>()), ref_loss.item<double>(),
                  1e-5 * std::abs(ref_loss.item<double>()))
          << "step " << step;
      // Gradients: each rank's shard equals the reference gradient's shard.
      auto ref_params = reference->named_parameters();
      for (auto& [name, value] : FSDPModule(model.ptr()).state_dict()) {
        const DTensor& d = std::get<DTensor>(value);
        at::Tensor ref_grad = distribute_tensor(ref_params[name].grad(), d.layout()).local();
        at::Tensor grad = model->named_parameters()[name].grad();
        ASSERT_TRUE(grad.defined()) << name;
        EXPECT_TRUE(test::tensors_close(grad, ref_grad, 1e-5, 1e-6)) << name << " step " << step;
      }
      ref_opt.step();
      ref_opt.zero_grad();
      opt.step();
      opt.zero_grad();
    }
    auto gathered = test::full_parameters(*model);
    for (auto& item : reference->named_parameters()) {
      EXPECT_TRUE(test::tensors_close(gathered.at(item.key()), item.value(), 1e-4, 1e-5))
          << item.key();
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
