// No-sync gradient accumulation on a GPU: a step of two micro-batches, the
// first with set_requires_gradient_sync(false) (each rank keeps its full
// gradient, no collective), the second synced, gives the gradient of one
// large batch: the sum of the two micro-batches' means, averaged over the
// ranks. Against one process that adds the same 2 n parts (n ranks) in
// another order: reordered_sum_bound(2 Σ|parts| / 2n, 2n, fp32), the factor
// 2 exact (tests/cuda/gpt_parity.h).
#include <gtest/gtest.h>

#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, NoSyncMicroBatchesAddUpToOneLargeBatch) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "comm_fusion" : "per parameter");
    TrainingCase c;
    c.options.mesh = mesh_;
    c.options.comm_fusion = fused;
    c.micro_batches = 2;
    expect_training_matches(c);
  }
}

}  // namespace
}  // namespace hp::cuda_test
