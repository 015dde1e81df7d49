// The pipeline over real processes (hprun): pipeline rank = global rank,
// point-to-point over the world group (Gloo), every schedule against the
// whole model trained in this process on the same micro-batches.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <set>

#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/llama.h"
#include "hp/pp/transport.h"
#include "hp/tp/llama_plan.h"
#include "hp/tp/sharding_plan.h"
#include "tests/pp/pipeline_parity.h"
#include "tests/support/model_configs.h"
#include "tests/support/tensor_checks.h"

namespace hp::pp {
namespace {

using parity::Case;

void expect_parity_on_world(Case c) {
  c.ranks = hp::test::world_size();
  const int rank = hp::test::rank();
  const parity::Run reference = parity::reference_run(c);
  auto transport = std::make_shared<GroupTransport>(dist::world_group());
  const parity::Run run = parity::pipeline_run(c, parity::build_stages(c, rank), transport);
  parity::expect_rank_matches(c, rank, run, reference);
}

int p() { return hp::test::world_size(); }

TEST(PipelineRanks, GPipe) {
  expect_parity_on_world({ScheduleKind::kGPipe, 0, 1, p()});
}

TEST(PipelineRanks, OneForwardOneBackward) {
  expect_parity_on_world({ScheduleKind::k1F1B, 0, 1, p()});
  expect_parity_on_world({ScheduleKind::k1F1B, 0, 1, 2 * p()});
  // Uneven: the last stage holds one block.
  std::vector<std::string> points;
  for (int s = 1; s < p(); ++s) points.push_back("h." + std::to_string(s));
  expect_parity_on_world({ScheduleKind::k1F1B, 0, 1, p() + 1, points});
  expect_parity_on_world({ScheduleKind::k1F1B, 0, 1, p(), {}, /*checkpointing=*/true});
}

TEST(PipelineRanks, Interleaved) {
  expect_parity_on_world({ScheduleKind::kInterleaved1F1B, 0, 2, 2 * p()});
}

TEST(PipelineRanks, ZeroBubble) {
  expect_parity_on_world({ScheduleKind::kZeroBubble, 0, 2, 2 * p()});
  expect_parity_on_world({ScheduleKind::kZeroBubble, 0, 2, p(), {}, /*checkpointing=*/true});
}

// Two replicas of a 2-stage pipeline on 4 ranks (mesh (dp, pp) = (2, 2)):
// each trains on its half of the batch, the stages' gradients averaged over
// the replicas.
TEST(PipelineRanks, DataParallelReplicas) {
  if (hp::test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks, has " << p();
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    Case c{kind, 2, kind == ScheduleKind::k1F1B ? 1 : 2, 4};
    c.data_parallel = 2;
    auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "pp"});
    const int replica = static_cast<int>(mesh->coordinate(0));
    const int pipeline_rank = static_cast<int>(mesh->coordinate(1));
    const parity::Run reference = parity::reference_run(c);
    const parity::Run run =
        parity::pipeline_run(c, parity::build_stages(c, pipeline_rank),
                             std::make_shared<GroupTransport>(mesh->group_ptr(1)), replica,
                             mesh->group_ptr(0));
    parity::expect_rank_matches(c, pipeline_rank, run, reference, replica);
  }
}

// The stages sharded by fully_shard over the data-parallel dim of a
// (dp, pp) = (2, 2) mesh, in fp32 and in bf16: each stage gathered across the step's
// micro-batches, its gradients reduce-scattered once per step. Bit for bit:
// the gathered parameters are copies, each rank's micro-batch gradients
// accumulate in micro-batch order as the reference's replica does, and the
// average of two is the reference's sum of the two halved (exact); AdamW is
// elementwise on the shards.
TEST(PipelineRanks, FullyShardedStages) {
  if (hp::test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks, has " << p();
  auto mesh = init_device_mesh("cpu", {2, 2}, {"dp", "pp"});
  const int replica = static_cast<int>(mesh->coordinate(0));
  const int pipeline_rank = static_cast<int>(mesh->coordinate(1));
  const std::vector<Case> cases = {
      {ScheduleKind::kGPipe, 2, 1, 2},
      {ScheduleKind::k1F1B, 2, 1, 4},
      {ScheduleKind::kInterleaved1F1B, 2, 2, 4},
      {ScheduleKind::kZeroBubble, 2, 2, 4},
      {ScheduleKind::k1F1B, 2, 1, 2, {}, /*checkpointing=*/true},
      {ScheduleKind::kZeroBubble, 2, 2, 2, {}, /*checkpointing=*/true},
  };
  std::vector<Case> all = cases;
  // Mixed precision (bf16 parameters and compute, fp32 reduction): each
  // micro-batch's bf16 gradient added to an fp32 sum, in order, as the
  // reference adds them (pipeline_parity.h); the split backward's W too.
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    Case c{kind, 2, kind == ScheduleKind::k1F1B ? 1 : 2, 4};
    c.compute_dtype = at::kBFloat16;
    all.push_back(c);
  }
  for (Case c : all) {
    c.data_parallel = 2;
    c.fully_shard = true;
    const parity::Run reference = parity::reference_run(c);
    const parity::Run run = parity::pipeline_run(
        c, parity::build_stages(c, pipeline_rank),
        std::make_shared<GroupTransport>(mesh->group_ptr(1)), replica, nullptr, (*mesh)["dp"]);
    parity::expect_rank_matches(c, pipeline_rank, run, reference, replica);
  }
}

// Tensor parallelism inside the stages: (pp, tp) = (2, 2), each stage's two
// tensor-parallel ranks running the same row; stage boundaries carry the
// hidden states' replicated values. Against the same TP model in one stage.
TEST(PipelineRanks, TensorParallelStages) {
  if (hp::test::world_size() != 4) GTEST_SKIP() << "needs 4 ranks, has " << p();
  auto mesh = init_device_mesh("cpu", {2, 2}, {"pp", "tp"});
  const int pipeline_rank = static_cast<int>(mesh->coordinate(0));
  for (Case c : std::vector<Case>{{ScheduleKind::k1F1B, 2, 1, 4},
                                  {ScheduleKind::kZeroBubble, 2, 2, 2},
                                  {ScheduleKind::kGPipe, 2, 1, 2, {}, /*checkpointing=*/true}}) {
    c.tp_mesh = (*mesh)["tp"];
    const parity::Run reference = parity::reference_run(c);
    const parity::Run run =
        parity::pipeline_run(c, parity::build_stages(c, pipeline_rank),
                             std::make_shared<GroupTransport>(mesh->group_ptr(0)));
    parity::expect_rank_matches(c, pipeline_rank, run, reference);
  }
  // Mixed precision (bf16 compute, fp32 reduction) in tensor-parallel
  // stages: fully_shard units over a data-parallel dim of one rank, which
  // only cast (hp-train's tp stages given --param-dtype). Against the TP
  // model cast to bf16, its micro-batches' gradients added in fp32 in order.
  auto cast_mesh = init_device_mesh("cpu", {1, 2, 2}, {"dp", "pp", "tp"});
  for (ScheduleKind kind : {ScheduleKind::k1F1B, ScheduleKind::kZeroBubble}) {
    Case c{kind, 2, kind == ScheduleKind::k1F1B ? 1 : 2, 4};
    c.compute_dtype = at::kBFloat16;
    c.fully_shard = true;
    c.tp_mesh = (*cast_mesh)["tp"];
    const parity::Run reference = parity::reference_run(c);
    const parity::Run run = parity::pipeline_run(
        c, parity::build_stages(c, pipeline_rank),
        std::make_shared<GroupTransport>(cast_mesh->group_ptr(1)), 0, nullptr, (*cast_mesh)["dp"]);
    parity::expect_rank_matches(c, pipeline_rank, run, reference);
  }
}

// 3-D: (dp, pp, tp) = (2, 2, 2) on 8 ranks, each stage tensor-parallel
// over tp and fully sharded over dp. Against the TP model in one stage,
// its two replicas' gradients averaged (exact for two, as above).
TEST(PipelineRanks, ThreeDimensional) {
  if (hp::test::world_size() != 8) GTEST_SKIP() << "needs 8 ranks, has " << p();
  auto mesh = init_device_mesh("cpu", {2, 2, 2}, {"dp", "pp", "tp"});
  const int replica = static_cast<int>(mesh->coordinate(0));
  const int pipeline_rank = static_cast<int>(mesh->coordinate(1));
  Case bf16{ScheduleKind::k1F1B, 2, 1, 2};
  bf16.compute_dtype = at::kBFloat16;  // as in FullyShardedStages
  for (Case c : std::vector<Case>{{ScheduleKind::k1F1B, 2, 1, 2},
                                  {ScheduleKind::kZeroBubble, 2, 2, 2},
                                  bf16}) {
    c.data_parallel = 2;
    c.fully_shard = true;
    c.tp_mesh = (*mesh)["tp"];
    const parity::Run reference = parity::reference_run(c);
    const parity::Run run = parity::pipeline_run(
        c, parity::build_stages(c, pipeline_rank),
        std::make_shared<GroupTransport>(mesh->group_ptr(1)), replica, nullptr, (*mesh)["dp"]);
    parity::expect_rank_matches(c, pipeline_rank, run, reference, replica);
  }
}

// A stage's share of a tensor-parallel plan (plan_for_part): the layouts
// of its parameters and the input and output layouts of its modules,
// nothing of the other stages' (shard_module refuses entries it does not
// find). The Llama's plan has all three kinds.
TEST(PipelineRanks, StagesTakeTheirShareOfTheTensorParallelPlan) {
  auto mesh = init_device_mesh("cpu", {p(), 1}, {"dp", "tp"});
  nn::LlamaConfig config = hp::test::tiny_llama_config();
  config.n_layer = 4;
  nn::Llama whole(config, c10::Device(c10::kMeta));
  const ShardingPlan plan = llama_tensor_parallel_plan(config, *(*mesh)["tp"]);
  const StagePlan stages = plan_stages(llama_layout(config), 2);
  size_t parameters = 0, outputs = 0, inputs = 0;
  for (int s = 0; s < 2; ++s) {
    StageModule stage = llama_stage(*whole, stages, s);
    const ShardingPlan share = plan_for_part(plan, *stage);
    std::set<std::string> expected;
    for (const auto& item : stage->named_parameters())
      if (plan.plan.count(item.key())) expected.insert(item.key());
    std::set<std::string> got;
    for (const auto& entry : share.plan) got.insert(entry.first);
    EXPECT_EQ(got, expected) << "stage " << s;
    EXPECT_FALSE(got.empty()) << "stage " << s;
    const auto modules = stage->named_modules("", /*include_self=*/false);
    for (const auto& [key, layouts] : share.output_plan)
      EXPECT_TRUE(modules.contains(key.substr(0, key.size() - 7))) << key << ", stage " << s;
    EXPECT_EQ(share.input_plan.count("model.layers.0.input"), s == 0 ? 1u : 0u);
    parameters += share.plan.size();
    outputs += share.output_plan.size();
    inputs += share.input_plan.size();
  }
  // Between them the stages take the whole plan.
  EXPECT_EQ(parameters, plan.plan.size());
  EXPECT_EQ(outputs, plan.output_plan.size());
  EXPECT_EQ(inputs, plan.input_plan.size());
}

TEST(PipelineRanks, Llama) {
  expect_parity_on_world({ScheduleKind::k1F1B, 0, 1, p(), {}, false, /*llama=*/true});
}

}  // namespace
}  // namespace hp::pp
