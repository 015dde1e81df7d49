// A dim-1 shard on a GPU: shard_placement_fn puts every matrix's Shard on
// dim 1 (each rank a block of columns, which the all-gather's rank-major
// output must interleave back), the vectors on dim 0; training matches one
// process within the bounds of tests/cuda/gpt_parity.h (the placement moves
// values, adds nothing).
#include <gtest/gtest.h>

#include <optional>

#include "hp/tensor/placement.h"
#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, DimOneShardsTrainLikeOneProcess) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "comm_fusion" : "per parameter");
    TrainingCase c;
    c.options.mesh = mesh_;
    c.options.comm_fusion = fused;
    c.options.shard_placement_fn = [](const at::Tensor& p) -> std::optional<Placement> {
      if (p.dim() == 2) return Shard(1);
      return std::nullopt;
    };
    c.shard_dim = [](const at::Tensor& p) -> int64_t { return p.dim() == 2 ? 1 : 0; };
    expect_training_matches(c);
  }
}

}  // namespace
}  // namespace hp::cuda_test
