// fully_shard after failures (docs/design.md, "Failures"): an exception in a
// user's forward or in a hook during backward, raised on every rank and
// caught, leaves the model exactly as if the failed attempt had not
// happened; a failed collective leaves it unusable with a message that says
// so, before any further collective. Also the refusals and guards around
// the lifecycle: changing reshard_after_forward between forward and
// backward, a graph that outlives its units, an optimizer step during an
// asynchronous unshard, and a fully_shard whose rendezvous fails.
//
// Comparisons: a recovered run is compared with an undisturbed run of the
// same configuration in the same processes. Both issue the same operations
// and collectives in the same order on the same data, so they must agree
// bit for bit (no tolerance). The step after a failure is also compared
// with the single-process reference, within the bounds summation order
// explains (tests/fsdp/data_parallel_reference.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <thread>

#include "hp/distributed/collectives.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/tensor/shard_spec.h"
#include "hp/util/error.h"
#include "tests/fsdp/data_parallel_reference.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/toy_model.h"
#include "tests/support/tensor_checks.h"

namespace hp {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// A block whose forward raises halfway (after its first layer ran) while
// `fail` is set: a shape error or a bad batch in a user's module.
struct FlakyBlockImpl : nn::Module {
  FlakyBlockImpl(int64_t d, int64_t hidden) : nn::Module("FlakyBlock") {
    fc1 = register_module("fc1", torch::nn::Linear(d, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, d));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = torch::gelu(fc1(x));
    if (fail) throw std::runtime_error("bad batch in FlakyBlock");
    return x + fc2(h);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  bool fail = false;
};
HP_MODULE(FlakyBlock);

struct FlakyModelImpl : nn::Module {
  explicit FlakyModelImpl(int64_t layers) : nn::Module("FlakyModel") {
    embed = register_module("embed", torch::nn::Linear(6, 10));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int64_t i = 0; i < layers; ++i) {
      FlakyBlock b(10, 14);
      blocks->push_back(b);
      block_list.push_back(b);
    }
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(10, 5).bias(false)));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = embed(x);
    for (size_t i = 0; i < block_list.size(); ++i) {
      h = block_list[i](h);
      if (i == 1 && on_block1_output) on_block1_output(h);
    }
    return head(h);
  }
  torch::nn::Linear embed{nullptr}, head{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<FlakyBlock> block_list;
  std::function<void(const at::Tensor&)> on_block1_output;
};
HP_MODULE(FlakyModel);

FlakyModel make_flaky_model() {
  torch::manual_seed(4321);
  return FlakyModel(3);
}

struct Config {
  std::string name;
  bool comm_fusion;
  bool reshard_after_forward;
};

std::vector<Config> configs() {
  return {{"per-parameter reshard", false, true},
          {"per-parameter keep", false, false},
          {"fused reshard", true, true}};
}

FSDPModule shard(FlakyModel& model, const Config& config) {
  FullyShardOptions options;
  options.comm_fusion = config.comm_fusion;
  options.reshard_after_forward = config.reshard_after_forward;
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  return fully_shard(model.ptr(), options);
}

at::Tensor step_loss(FlakyModel& model, int step) {
  const int64_t rank = dist::get_rank(), world = dist::get_world_size();
  auto [x, y] = test::global_batch(step);
  return torch::mse_loss(model(test::rows_for(x, rank, world)), test::rows_for(y, rank, world));
}

enum class Failure { kNone, kForward, kBackwardHook };

// Three SGD steps; before step 1 a failed attempt of the kind given, raised
// on every rank and caught. Returns the whole parameters and the losses.
std::pair<std::map<std::string, at::Tensor>, std::vector<double>> train(const Config& config,
                                                                        Failure failure) {
  auto model = make_flaky_model();
  FSDPModule root = shard(model, config);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    if (step == 1 && failure == Failure::kForward) {
      model->block_list[1]->fail = true;
      EXPECT_THAT([&] { step_loss(model, step); },
                  ThrowsMessage<std::runtime_error>(HasSubstr("bad batch in FlakyBlock")));
      model->block_list[1]->fail = false;
    }
    if (step == 1 && failure == Failure::kBackwardHook) {
      // Raised while block 2's gradients are being reduced and block 1's
      // backward has not started.
      model->on_block1_output = [](const at::Tensor& h) {
        h.register_hook([](const at::Tensor&) -> at::Tensor {
          throw std::runtime_error("hook failed in backward");
        });
      };
      at::Tensor loss = step_loss(model, step);
      EXPECT_THAT([&] { loss.backward(); },
                  ThrowsMessage<std::exception>(HasSubstr("hook failed in backward")));
      model->on_block1_output = nullptr;
    }
    at::Tensor loss = step_loss(model, step);
    loss.backward();
    opt.step();
    root.zero_grad();
    losses.push_back(loss.item<double>());
  }
  return {test::full_parameters(*model), losses};
}

// In every configuration, training with the failed attempt gives bitwise
// the losses and parameters of training without it.
void expect_no_trace(Failure failure) {
  for (const Config& config : configs()) {
    SCOPED_TRACE(config.name);
    auto expected = train(config, Failure::kNone);
    auto actual = train(config, failure);
    EXPECT_EQ(actual.second, expected.second);
    for (const auto& [name, tensor] : expected.first) {
      EXPECT_TRUE(test::tensors_equal(actual.first.at(name), tensor)) << name;
    }
  }
}

TEST(FullyShardFailures, ForwardExceptionLeavesNoTrace) { expect_no_trace(Failure::kForward); }

TEST(FullyShardFailures, BackwardHookExceptionLeavesNoTrace) {
  expect_no_trace(Failure::kBackwardHook);
}

// After a failed attempt, the next step's loss and gradient shards against
// the single-process reference of the same step, within the bounds that
// summation order explains (tests/fsdp/data_parallel_reference.h).
TEST(FullyShardFailures, StepAfterAFailureMatchesOneProcess) {
  for (Failure failure : {Failure::kForward, Failure::kBackwardHook}) {
    SCOPED_TRACE(failure == Failure::kForward ? "forward" : "backward hook");
    auto reference = make_flaky_model();
    auto model = make_flaky_model();
    shard(model, {"fused reshard", true, true});
    if (failure == Failure::kForward) {
      model->block_list[1]->fail = true;
      EXPECT_ANY_THROW(step_loss(model, 0));
      model->block_list[1]->fail = false;
    } else {
      model->on_block1_output = [](const at::Tensor& h) {
        h.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("hook"); });
      };
      at::Tensor loss = step_loss(model, 0);
      EXPECT_ANY_THROW(loss.backward());
      model->on_block1_output = nullptr;
    }
    auto [x, y] = test::global_batch(0);
    test::expect_mse_step_matches(model, reference, x, y);
  }
}

TEST(FullyShardFailures, ForwardExceptionReshardsEveryUnit) {
  auto model = make_flaky_model();
  shard(model, {"fused reshard", true, true});
  model->block_list[1]->fail = true;
  EXPECT_ANY_THROW(step_loss(model, 0));
  // Every parameter holds its shard again (block 1 was gathered when it
  // raised, block 2 prefetched).
  const int64_t shard_rows = chunk_span(14, dist::get_world_size(), dist::get_rank()).size;
  for (auto& block : model->block_list) EXPECT_EQ(block->fc1->weight.size(0), shard_rows);
}

TEST(FullyShardFailures, BackwardExceptionDropsItsGradients) {
  auto model = make_flaky_model();
  shard(model, {"per-parameter reshard", false, true});
  model->on_block1_output = [](const at::Tensor& h) {
    h.register_hook([](const at::Tensor&) -> at::Tensor { throw std::runtime_error("boom"); });
  };
  at::Tensor loss = step_loss(model, 0);
  EXPECT_ANY_THROW(loss.backward());
  // Block 2 and the head had their gradients reduced before the hook
  // raised; they would be a partial step, so none is left.
  for (const auto& p : model->parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(FullyShardFailures, ReshardAfterForwardCannotChangeBetweenForwardAndBackward) {
  if (dist::get_world_size() != 4) GTEST_SKIP() << "regathering in pairs needs 4 ranks";
  auto model = make_flaky_model();
  FullyShardOptions options;
  options.reshard_after_forward = int64_t{2};
  for (auto& block : model->block_list) fully_shard(block.ptr(), options);
  FSDPModule root = fully_shard(model.ptr(), options);
  at::Tensor loss = step_loss(model, 0);
  EXPECT_THAT([&] { root.set_reshard_after_forward(true); },
              ThrowsMessage<ArgumentError>(HasSubstr("between its forward and backward")));
  EXPECT_THAT([&] { root.set_reshard_after_forward(int64_t{4}); },
              ThrowsMessage<ArgumentError>(HasSubstr("holds pieces for a regather")));
  loss.backward();  // still regathers in pairs
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
  root.set_reshard_after_forward(true);  // after backward: allowed
  step_loss(model, 1).backward();
}

TEST(FullyShardFailures, ReshardAfterBackwardFalseKeepsACopyBesideTheShards) {
  if (dist::get_world_size() < 2) GTEST_SKIP() << "needs a shard group";
  const int64_t shard_rows = chunk_span(14, dist::get_world_size(), dist::get_rank()).size;
  auto model = make_flaky_model();
  FSDPModule root = shard(model, {"per-parameter reshard", false, true});
  root.set_reshard_after_backward(false);
  for (bool sync : {false, true}) {
    SCOPED_TRACE(sync ? "gradient sync" : "no sync");
    root.set_requires_gradient_sync(sync);
    step_loss(model, 0).backward();
    // The parameters hold their shards (an optimizer could step them) ...
    for (auto& block : model->block_list) EXPECT_EQ(block->fc1->weight.size(0), shard_rows);
    // ... and the next forward gathers nothing: the copies are current.
    const int64_t gathers = dist::comm_stats()[dist::OpType::kAllGather];
    at::Tensor loss = step_loss(model, 1);
    EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllGather], gathers);
    loss.backward();
  }
  // A write to a shard (here in place, as an optimizer's step does) makes
  // its copy stale: the next forward gathers that parameter again (one
  // all-gather per parameter without comm_fusion), and only that one.
  {
    at::NoGradGuard no_grad;
    model->block_list[0]->fc1->weight.add_(1.0);
  }
  const int64_t gathers = dist::comm_stats()[dist::OpType::kAllGather];
  at::Tensor loss = step_loss(model, 2);
  EXPECT_EQ(dist::comm_stats()[dist::OpType::kAllGather], gathers + 1);
  loss.backward();
}

TEST(FullyShardFailures, GraphOutlivingItsUnitsIsSafe) {
  at::Tensor loss;
  std::vector<at::Tensor> params;
  {
    auto model = make_flaky_model();
    FullyShardOptions options;
    options.reshard_after_forward = false;  // the graph keeps gathered weights
    for (auto& block : model->block_list) fully_shard(block.ptr(), options);
    fully_shard(model.ptr(), options);
    loss = step_loss(model, 0);
    params = model->parameters();
  }
  // The units are gone; their post-accumulate hooks must do nothing.
  loss.backward();
  for (const auto& p : params) EXPECT_TRUE(p.grad().defined());
}

TEST(FullyShardFailures, AsyncUnshardGathersTheShardsOfItsCall) {
  const int64_t rank = dist::get_rank();
  for (bool fusion : {false, true}) {
    SCOPED_TRACE(fusion ? "fused" : "per-parameter");
    auto reference = make_flaky_model();
    auto model = make_flaky_model();
    FullyShardOptions options;
    options.comm_fusion = fusion;
    FSDPModule block = fully_shard(model->block_list[0].ptr(), options);
    // Rank 0 changes its shards in place (as optimizer.step() would) before
    // its peers have even issued the gather, so a gather that read the live
    // shards would deliver the changed values.
    if (rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    UnshardHandle handle = block.unshard(/*async_op=*/true);
    if (rank == 0) {
      at::NoGradGuard no_grad;
      for (auto& p : model->block_list[0]->parameters()) p.add_(1000.0);
    }
    handle.wait();
    EXPECT_TRUE(test::tensors_equal(model->block_list[0]->fc1->weight,
                                    reference->block_list[0]->fc1->weight));
    block.reshard();
    dist::barrier(*dist::world_group()).wait();
  }
}

TEST(FullyShardFailures, FailedRendezvousLeavesTheModelUntouched) {
  const int rank = dist::get_rank();
  if (dist::get_world_size() != 4 || !std::getenv("HP_FAILURE_TIMEOUT_TESTS")) {
    GTEST_SKIP() << "runs on 4 ranks with a short timeout (fsdp.failures.timeout.n4)";
  }
  // The world's timeout is short here; the final barrier waits longer.
  auto patient = dist::new_group({0, 1, 2, 3}, {"patient", std::chrono::seconds(60)});
  auto reference = make_flaky_model();
  auto model = make_flaky_model();
  FullyShardOptions options;
  options.mesh = init_device_mesh("cpu", {4}, {"dp"});
  fully_shard(model->block_list[0].ptr(), options);  // the mesh's groups exist now
  options.reshard_after_forward = int64_t{2};
  if (rank == 2) {
    // Rank 3 never joins the regather group {2, 3}.
    EXPECT_THROW(fully_shard(model->block_list[1].ptr(), options), CollectiveError);
    EXPECT_FALSE(is_fully_sharded(*model->block_list[1]));
    auto expected = reference->block_list[1]->named_parameters();
    for (const auto& item : model->block_list[1]->named_parameters()) {
      EXPECT_TRUE(test::tensors_equal(item.value(), *expected.find(item.key()))) << item.key();
    }
  } else if (rank < 2) {
    fully_shard(model->block_list[1].ptr(), options);
  }
  dist::barrier(*patient).wait();
}

TEST(FullyShardFailures, CollectiveTimeoutMakesTheModelUnusable) {
  if (dist::get_world_size() != 2 || !std::getenv("HP_FAILURE_TIMEOUT_TESTS")) {
    GTEST_SKIP() << "runs on 2 ranks with a short timeout (fsdp.failures.timeout.n2)";
  }
  auto model = make_flaky_model();
  FSDPModule root = shard(model, {"per-parameter reshard", false, true});
  // Rank 1 stalls in block 1's forward for longer than the collective
  // timeout; rank 0 waits for block 2's gather meanwhile and times out.
  struct Stall {
    static void maybe(const at::Tensor&) {
      if (dist::get_rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(15));
    }
  };
  model->on_block1_output = Stall::maybe;
  bool collective_failed = false;
  for (int step = 0; step < 3 && !collective_failed; ++step) {
    try {
      step_loss(model, step).backward();
    } catch (const CollectiveError&) {
      collective_failed = true;
    }
  }
  ASSERT_TRUE(collective_failed);
  model->on_block1_output = nullptr;
  // From now on every use says what happened, before any collective.
  EXPECT_THAT([&] { step_loss(model, 3); },
              ThrowsMessage<UnusableError>(HasSubstr("are unusable: a collective failed")));
  EXPECT_THAT([&] { root.unshard(); }, ThrowsMessage<UnusableError>(HasSubstr("Rebuild")));
}

}  // namespace
}  // namespace hp
