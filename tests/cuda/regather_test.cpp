// A kept copy regathered on a GPU: with reshard_after_backward false every
// unit keeps its gathered parameters after backward; the optimizer's step
// then changes the shards under it, so the next forward must see the
// shards' version counters moved and gather again (docs/streams.md: the
// copy-in waits the unit's own reshard event). A stale copy would compute
// the next step's loss on the old parameters: the exact loss comparison of
// tests/cuda/gpt_parity.h catches it (an AdamW step at lr 1e-2 moves every
// parameter by far more than rounding).
#include <gtest/gtest.h>

#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, KeptCopyIsRegatheredAfterTheOptimizerStep) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "comm_fusion" : "per parameter");
    TrainingCase c;
    c.options.mesh = mesh_;
    c.options.comm_fusion = fused;
    c.steps = 3;
    c.configure = [](FSDPModule& root) { root.set_reshard_after_backward(false); };
    expect_training_matches(c);
  }
}

}  // namespace
}  // namespace hp::cuda_test
