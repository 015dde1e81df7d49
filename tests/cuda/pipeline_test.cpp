// The pipeline on a GPU: every rank's stages on CUDA, the activations and
// their gradients sent between ranks by the pipeline group's backend (NCCL
// natively, batched; Gloo through host copies under HP_CUDA_BACKEND=gloo),
// against one process training the whole model on the same GPU with the
// same micro-batches (tests/pp/pipeline_parity.h). Bit for bit, as on the
// CPU: each stage runs the kernels the whole model runs on the same values,
// each gradient accumulates over the micro-batches in the same order, and a
// transfer copies bytes. Deterministic kernels are asked for, so that no
// kernel sums with atomics in an order that changes from call to call.
#include <gtest/gtest.h>

#include <ATen/Context.h>

#include <memory>
#include <vector>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "hp/pp/transport.h"
#include "tests/cuda/on_cuda.h"
#include "tests/pp/pipeline_parity.h"

namespace hp::cuda_test {
namespace {

using pp::ScheduleKind;
using pp::parity::Case;

class PipelineOnCuda : public OnCuda {
 protected:
  void SetUp() override {
    OnCuda::SetUp();
    if (IsSkipped()) return;
    deterministic_ = at::globalContext().deterministicAlgorithms();
    // warn_only: an op without a deterministic CUDA kernel warns instead of
    // raising; the comparison then says whether its order mattered.
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
  }
  void TearDown() override {
    if (!IsSkipped()) at::globalContext().setDeterministicAlgorithms(deterministic_, false);
  }
  bool deterministic_ = false;
};

// One stage per rank (GPipe, 1F1B), two per rank (interleaved, zero bubble:
// the backward split into its input and weight halves on the GPU), and
// 1F1B with every block checkpointed, over the world's ranks.
TEST_F(PipelineOnCuda, StagesTrainTheOneProcessModel) {
  const int world = dist::get_world_size();
  if (world < 2) GTEST_SKIP() << "a pipeline needs 2 or more ranks, has " << world;
  const int rank = dist::get_rank();
  std::vector<Case> cases = {{ScheduleKind::kGPipe, world, 1, world},
                             {ScheduleKind::k1F1B, world, 1, 2 * world},
                             {ScheduleKind::kInterleaved1F1B, world, 2, 2 * world},
                             {ScheduleKind::kZeroBubble, world, 2, 2 * world},
                             {ScheduleKind::k1F1B, world, 1, world, {}, /*checkpointing=*/true}};
  for (Case c : cases) {
    c.device = device_;
    const pp::parity::Run reference = pp::parity::reference_run(c);
    const pp::parity::Run run = pp::parity::pipeline_run(
        c, pp::parity::build_stages(c, rank),
        std::make_shared<pp::GroupTransport>(mesh_->group_ptr(0)));
    pp::parity::expect_rank_matches(c, rank, run, reference);
  }
}

// (dp, pp) = (2, 2) on 4 ranks: each stage fully_shard'ed over dp on the
// GPU, gathered once per step (UNSHARD) and reduced once (REDUCE_GRAD) on
// the streams, in fp32 and in bf16 (each micro-batch's gradient added to
// an fp32 sum). Against one process averaging the two replicas'
// gradients: a sum of two halved, exact whichever collective adds them.
TEST_F(PipelineOnCuda, ShardedStagesTrainTheOneProcessModel) {
  const int world = dist::get_world_size();
  if (world != 4) GTEST_SKIP() << "needs 4 ranks, has " << world;
  auto mesh = init_device_mesh("cuda", {2, 2}, {"dp", "pp"});
  const int replica = static_cast<int>(mesh->coordinate(0));
  const int pipeline_rank = static_cast<int>(mesh->coordinate(1));
  Case mixed{ScheduleKind::k1F1B, 2, 1, 4};
  mixed.compute_dtype = at::kBFloat16;
  for (Case c : std::vector<Case>{{ScheduleKind::k1F1B, 2, 1, 4},
                                  {ScheduleKind::kZeroBubble, 2, 2, 4}, mixed}) {
    c.data_parallel = 2;
    c.fully_shard = true;
    c.device = mesh->device();
    const pp::parity::Run reference = pp::parity::reference_run(c);
    const pp::parity::Run run = pp::parity::pipeline_run(
        c, pp::parity::build_stages(c, pipeline_rank),
        std::make_shared<pp::GroupTransport>(mesh->group_ptr(1)), replica, nullptr,
        (*mesh)["dp"]);
    pp::parity::expect_rank_matches(c, pipeline_rank, run, reference, replica);
  }
}

}  // namespace
}  // namespace hp::cuda_test
