// fully_shard's pipeline steps (FSDPModule::begin_pipeline_step): several
// micro-batches' forwards and backwards, interleaved as a pipeline schedule
// runs them, then one reduction. Compared with the same sharded model
// accumulating the same micro-batches the ordinary way (no-sync backwards,
// then a synchronised one), bit for bit: both sum the same whole gradients
// (a + b == b + a exactly, and the micro-batch order is the same) and reduce
// that sum with the same collective; AdamW is elementwise on the shards.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/util/error.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace pipeline_step_test {  // named: the test binary is a unity build

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

constexpr int64_t kMicroBatches = 3;

struct Sharded {
  test::ToyModel model = test::make_toy_model();
  FSDPModule root;
  // `mesh`: null for FSDP over the world, a 2-D one for HSDP. `mixed`: bf16
  // parameters and compute, fp32 reduction.
  explicit Sharded(DeviceMeshPtr mesh = nullptr, bool mixed = false)
      : root(shard(model, std::move(mesh), mixed)) {}
  static FSDPModule shard(test::ToyModel& m, DeviceMeshPtr mesh, bool mixed) {
    FullyShardOptions options;
    options.mesh = std::move(mesh);
    if (mixed) {
      options.mp_policy.param_dtype = at::kBFloat16;
      options.mp_policy.reduce_dtype = at::kFloat;
    }
    for (auto& block : m->block_list) fully_shard(block.ptr(), options);
    return fully_shard(m.ptr(), options);
  }
};

// This rank's micro-batch k of step `step`: different on every rank.
at::Tensor input(int step, int64_t k) {
  torch::manual_seed(1000 * step + 10 * k + test::rank());
  return torch::randn({4, 6});
}

at::Tensor loss_of(test::ToyModel& model, const at::Tensor& x) {
  return model(x).square().mean() / kMicroBatches;
}

// The ordinary accumulation: no-sync backwards, the last one synchronised.
void accumulate(Sharded& s, int step) {
  for (int64_t k = 0; k < kMicroBatches; ++k) {
    s.root.set_requires_gradient_sync(k == kMicroBatches - 1);
    loss_of(s.model, input(step, k)).backward();
  }
}

// A 1F1B-like interleaving of the same micro-batches: F0 F1 B0 F2 B1 B2.
void pipeline_step(Sharded& s, int step) {
  s.root.begin_pipeline_step();
  std::vector<at::Tensor> losses;
  losses.push_back(loss_of(s.model, input(step, 0)));
  losses.push_back(loss_of(s.model, input(step, 1)));
  losses[0].backward();
  losses.push_back(loss_of(s.model, input(step, 2)));
  losses[1].backward();
  losses[2].backward();
  s.root.finish_pipeline_step();
}

void expect_same(test::ToyModel& got, test::ToyModel& expected, const char* what) {
  auto a = got->named_parameters();
  auto b = expected->named_parameters();
  for (const auto& item : a) {
    const at::Tensor& p = item.value();
    const at::Tensor& q = b[item.key()];
    EXPECT_TRUE(test::tensors_equal(p, q)) << what << ": " << item.key();
    ASSERT_EQ(p.grad().defined(), q.grad().defined()) << what << ": " << item.key();
    if (p.grad().defined()) {
      EXPECT_TRUE(test::tensors_equal(p.grad(), q.grad())) << what << ": grad of " << item.key();
    }
  }
}

// In fp32 and in mixed precision (bf16 compute, fp32 reduction), where each
// micro-batch's bf16 gradient is added to an fp32 sum, as a no-sync
// backward keeps it, not summed in bf16 by autograd.
TEST(PipelineStep, EqualsOrdinaryAccumulation) {
  for (const bool mixed : {false, true}) {
    SCOPED_TRACE(mixed ? "bf16 compute, fp32 reduction" : "fp32");
    Sharded piped(nullptr, mixed), plain(nullptr, mixed);
    torch::optim::SGD sgd_piped(piped.model->parameters(), 0.1);
    torch::optim::SGD sgd_plain(plain.model->parameters(), 0.1);
    // Step 0 leaves its gradients in .grad (no zero_grad): the pipeline step
    // adds its own to them, as an accumulating backward does.
    accumulate(piped, 0);
    accumulate(plain, 0);
    for (int step = 1; step <= 2; ++step) {
      pipeline_step(piped, step);
      accumulate(plain, step);
      expect_same(piped.model, plain.model, "after the step's gradients");
      sgd_piped.step();
      sgd_plain.step();
      expect_same(piped.model, plain.model, "after the optimizer step");
    }
  }
}

// HSDP (2 replicas x 2 shards): the step's one reduction is a
// reduce-scatter over the shards and an all-reduce over the replicas, as
// the synchronised backward's.
TEST(PipelineStep, HybridShardingEqualsOrdinaryAccumulation) {
  if (test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks (2 x 2)";
  auto mesh = init_device_mesh("cpu", {2, 2}, {"replicate", "shard"});
  Sharded piped(mesh), plain(mesh);
  for (int step = 0; step <= 1; ++step) {
    pipeline_step(piped, step);
    accumulate(plain, step);
    expect_same(piped.model, plain.model, "HSDP");
  }
}

// A cancelled step drops the micro-batches' gradients it kept in the
// reduce dtype, and only those: a no-sync gradient kept before the step
// is reduced with the next synchronised backward, as if the step had not
// begun.
TEST(PipelineStep, ACancelledMixedPrecisionStepKeepsOnlyWhatCameBefore) {
  Sharded s(nullptr, /*mixed=*/true), reference(nullptr, /*mixed=*/true);
  for (Sharded* t : {&s, &reference}) {
    t->root.set_requires_gradient_sync(false);
    loss_of(t->model, input(0, 0)).backward();
    t->root.set_requires_gradient_sync(true);
  }
  s.root.begin_pipeline_step();
  loss_of(s.model, input(1, 0)).backward();
  s.root.cancel_pipeline_step();
  for (Sharded* t : {&s, &reference}) loss_of(t->model, input(2, 0)).backward();
  expect_same(s.model, reference.model, "bf16, after the cancelled step");
}

TEST(PipelineStep, KeepsTheTreeGatheredUntilItEnds) {
  Sharded s;
  const auto shard_sizes = [&] {
    std::vector<std::vector<int64_t>> sizes;
    for (const auto& p : s.model->parameters()) sizes.push_back(p.sizes().vec());
    return sizes;
  };
  const auto sharded = shard_sizes();
  test::ToyModel whole = test::make_toy_model();
  std::vector<std::vector<int64_t>> full;
  for (const auto& p : whole->parameters()) full.push_back(p.sizes().vec());
  s.root.begin_pipeline_step();
  EXPECT_EQ(shard_sizes(), full);
  at::Tensor first = loss_of(s.model, input(0, 0));
  EXPECT_EQ(shard_sizes(), full) << "a forward inside the step freed its unit";
  first.backward();
  EXPECT_EQ(shard_sizes(), full) << "a backward inside the step resharded";
  s.root.finish_pipeline_step();
  EXPECT_EQ(shard_sizes(), sharded);
}

TEST(PipelineStep, AFailedForwardCancelsTheStep) {
  Sharded s, reference;
  accumulate(s, 0);
  accumulate(reference, 0);
  s.root.begin_pipeline_step();
  loss_of(s.model, input(1, 0)).backward();
  // A batch of the wrong width raises inside the first unit's forward (every
  // rank alike): the step's gradients go, the earlier ones stay.
  EXPECT_THROW(s.model(torch::randn({4, 7})), std::exception);
  expect_same(s.model, reference.model, "after the cancelled step");
  // The tree trains on as if the step had not begun.
  pipeline_step(s, 2);
  accumulate(reference, 2);
  expect_same(s.model, reference.model, "after the next step");
}

TEST(PipelineStep, MisuseIsRefusedBeforeAnyCollective) {
  Sharded s;
  EXPECT_THAT([&] { s.root.finish_pipeline_step(); },
              ThrowsMessage<ArgumentError>(HasSubstr("not in a pipeline step")));
  s.root.begin_pipeline_step();
  EXPECT_THAT([&] { FSDPModule(s.model->block_list[0].ptr()).begin_pipeline_step(); },
              ThrowsMessage<ArgumentError>(HasSubstr("call it on that tree's root module")));
  EXPECT_THAT([&] { s.root.begin_pipeline_step(); },
              ThrowsMessage<ArgumentError>(HasSubstr("already in a pipeline step")));
  s.root.cancel_pipeline_step();
  // A forward whose backward has not run yet holds the tree.
  at::Tensor pending = loss_of(s.model, input(0, 0));
  EXPECT_THAT([&] { s.root.begin_pipeline_step(); },
              ThrowsMessage<ArgumentError>(HasSubstr("in the middle of a forward or backward")));
  pending.backward();
  s.root.begin_pipeline_step();
  s.root.finish_pipeline_step();
}

}  // namespace pipeline_step_test
}  // namespace hp
