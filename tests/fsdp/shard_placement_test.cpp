// shard_placement_fn returning Shard(d) with d != 0: the parameter is
// split evenly along d (no padding), gathered by concatenating the pieces
// along d, its gradient reduced to the matching piece, and its state dict
// entry is a DTensor placed Shard(d). One unit mixes such parameters
// with dim-0 ones of uneven length, on every mesh this world supports, per
// parameter and fused, and trains like the single-process model.
//
// Tolerances are derived as in parity_test.cpp, none is a constant: the
// reference runs the ranks' slices in turn (data_parallel_backward), so
// losses and gradients, whatever dim a shard is cut along, may differ only
// by the order their world-size terms are added in (reordered_sum_bound of
// the terms it recorded), and parameters after AdamW by what AdamWBound
// derives from those (tests/fsdp/data_parallel_reference.h). Each step
// starts both from the reference's parameters.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/fsdp/fully_shard.h"
#include "hp/tensor/shard_spec.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

// in 12 -> d 12 -> hidden 14 -> out 5: every weight whose dim 1 is 12 is
// sharded on dim 1 (12 divides by 2, 3 and 4); fc1.weight [14, 12] is asked
// for as Shard(-1). fc2.weight [12, 14] and the biases stay on dim 0, where
// fc1.bias (14) is uneven on 3 and 4 ranks.
test::ToyModel make_model(uint64_t seed = 1234) {
  torch::manual_seed(seed);
  return test::ToyModel(12, 12, 14, 5, 2);
}

std::optional<Placement> placement_of(const at::Tensor& p) {
  if (p.dim() != 2 || p.size(1) != 12) return std::nullopt;
  return p.size(0) == 14 ? Shard(-1) : Shard(1);
}

bool on_dim1(const std::string& name) {
  return name == "embed.weight" || name == "head.weight" ||
         name.find("fc1.weight") != std::string::npos;
}

FullyShardOptions options_for(const test::MeshConfig& mesh, bool fused) {
  FullyShardOptions options;
  options.mesh = test::make_mesh(mesh);
  options.shard_placement_fn = placement_of;
  options.comm_fusion = fused;
  return options;
}

FSDPModule shard(test::ToyModel& model, const FullyShardOptions& options) {
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  return fully_shard(model.ptr(), options);
}

TEST(ShardPlacement, NonZeroDimShardsTrainLikeOneProcess) {
  const int64_t rank = dist::get_rank();
  for (const auto& mesh : test::mesh_configs()) {
    for (bool fused : {false, true}) {
      SCOPED_TRACE(mesh.name + (fused ? " fused" : " per parameter"));
      const FullyShardOptions options = options_for(mesh, fused);
      const int64_t shard_size = mesh.shape.back();
      const int64_t shard_rank = rank % shard_size;
      auto reference = make_model();
      auto ref_opt = test::make_adamw(*reference);
      auto model = make_model();
      std::map<std::string, std::vector<int64_t>> full_shapes;
      for (auto& item : model->named_parameters()) full_shapes[item.key()] = item.value().sizes().vec();
      FSDPModule root = shard(model, options);

      // Each parameter holds its piece: an even 1/shard_size of dim 1, or
      // torch.chunk's piece of dim 0.
      for (auto& item : model->named_parameters()) {
        std::vector<int64_t> expected = full_shapes.at(item.key());
        if (on_dim1(item.key())) {
          expected[1] /= shard_size;
        } else {
          expected[0] = chunk_span(expected[0], shard_size, shard_rank).size;
        }
        EXPECT_EQ(item.value().sizes().vec(), expected) << item.key();
      }
      for (auto& [name, value] : root.state_dict()) {
        const DTensor& d = std::get<DTensor>(value);
        EXPECT_EQ(d.sizes(), full_shapes.at(name)) << name;
        // A shard dim of size 1 (DDP) holds every parameter whole.
        const Placement expected =
            shard_size == 1 ? Replicate() : Shard(on_dim1(name) ? 1 : 0);
        EXPECT_EQ(d.placements().back().str(), expected.str()) << name;
      }

      auto opt = test::make_adamw(*model);
      test::AdamWBound adam(test::adamw_hyper());
      std::map<std::string, at::Tensor> param_bounds;
      for (int step = 0; step < 3; ++step) {
        SCOPED_TRACE("step " + std::to_string(step));
        test::copy_parameters(model, reference);
        auto [x, y] = test::global_batch(step, 12, 12, 5);
        // Each gradient piece, along dim 1 or dim 0, against the same piece
        // of the reference's gradient.
        auto grad_bounds = test::expect_mse_step_matches(model, reference, x, y);
        param_bounds = test::step_and_expect_parameters_match(model, reference, opt, ref_opt,
                                                              adam, grad_bounds);
      }
      // Gathered whole (pieces concatenated along their dim), the values
      // step_and_expect_parameters_match checked piece by piece.
      auto gathered = test::full_parameters(*model);
      for (auto& item : reference->named_parameters()) {
        EXPECT_TRUE(test::within_bound(gathered.at(item.key()), item.value(),
                                       param_bounds.at(item.key())))
            << item.key();
      }
    }
  }
}

TEST(ShardPlacement, NonZeroDimStateDictsLoadOtherValues) {
  for (const auto& mesh : test::mesh_configs()) {
    SCOPED_TRACE(mesh.name);
    const FullyShardOptions options = options_for(mesh, /*fused=*/false);
    // The values to load come from a model with other weights, so a load
    // that does nothing (or lands a piece in the wrong place) shows.
    auto source = make_model(/*seed=*/1);
    FSDPModule source_root = shard(source, options);
    const auto expected = test::full_parameters(*source);
    auto plain_source = make_model(/*seed=*/1);
    for (auto& item : plain_source->named_parameters()) {
      EXPECT_TRUE(test::tensors_equal(expected.at(item.key()), item.value())) << item.key();
    }
    StateDict local = source_root.state_dict();
    StateDict plain_local;
    for (const auto& [name, value] : local) {
      plain_local.emplace_back(name, std::get<DTensor>(value).local().clone());
    }
    StateDict whole = get_model_state_dict(*source, {/*full_state_dict=*/true});
    for (const StateDict* sd : {&local, &plain_local, &whole}) {
      auto target = make_model(/*seed=*/2);
      FSDPModule root = shard(target, options);
      root.load_state_dict(*sd);
      auto loaded = test::full_parameters(*target);
      for (const auto& [name, tensor] : expected) {
        EXPECT_TRUE(test::tensors_equal(loaded.at(name), tensor)) << name;
      }
    }
  }
}

}  // namespace
}  // namespace hp
