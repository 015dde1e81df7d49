// One tensor-parallel redistribute on a GPU: a DTensor sharded on rows
// (Shard(0)) over the CUDA mesh becomes Replicate, an all-gather over NCCL
// (or Gloo with CUDA tensors): every rank then holds the whole tensor,
// bit for bit (an all-gather moves values, adds nothing), on its GPU.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "hp/tensor/dtensor.h"
#include "hp/tensor/layout.h"
#include "hp/tensor/placement.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, RedistributeShardToReplicateGivesTheWholeTensor) {
  const int64_t w = mesh_->size(), r = mesh_->coordinate(0);
  // 3 rows a rank, 5 columns: values that differ everywhere.
  at::Tensor whole = at::randn({3 * w, 5}, at::detail::createCPUGenerator(21));
  at::Tensor local = whole.chunk(w, 0)[r].contiguous().to(device_);
  DTensor sharded = from_local(local, Layout(mesh_, {Shard(0)}));
  DTensor replicated = sharded.redistribute(Placements{Replicate()});
  EXPECT_TRUE(replicated.local().is_cuda());
  EXPECT_EQ(replicated.local().device(), device_);
  EXPECT_TRUE(at::equal(replicated.local().cpu(), whole));
  EXPECT_TRUE(at::equal(sharded.full_tensor().cpu(), whole));
}

}  // namespace
}  // namespace hp::cuda_test
