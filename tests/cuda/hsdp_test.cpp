// HSDP on a GPU: a (replicate 2, shard 2) CUDA mesh trains as one process
// does. Each parameter is sharded over the shard dim and its gradient
// averaged by a reduce-scatter over the shard ranks and an all-reduce over
// the replicas: the 4 ranks' parts added in another order, with two exact
// halvings, so within reordered_sum_bound(Σ|parts|, 4, fp32)
// (tests/cuda/gpt_parity.h).
#include <gtest/gtest.h>

#include "hp/distributed/world.h"
#include "hp/mesh/device_mesh.h"
#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, HsdpTrainsLikeOneProcess) {
  if (dist::get_world_size() != 4) GTEST_SKIP() << "a 2 x 2 mesh needs 4 ranks";
  DeviceMeshPtr hsdp = init_device_mesh("cuda", {2, 2}, {"replicate", "shard"});
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "comm_fusion" : "per parameter");
    TrainingCase c;
    c.options.mesh = hsdp;
    c.options.comm_fusion = fused;
    expect_training_matches(c);
  }
}

}  // namespace
}  // namespace hp::cuda_test
