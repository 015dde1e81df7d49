// bf16 mixed precision on a GPU (docs/gpu.md's recipe: param_dtype bf16,
// reduce_dtype fp32, fp32 shards and logits) trains as one process does.
//
// The bound, derived: the reference is the one-process run of the fp32
// parameters with bf16 compute (each part on a bf16 copy of the fp32
// parameters, as tests/fsdp/gpt_fixture.h's reference_backward does), so
// each rank's bf16 forward and backward are the reference's bit for bit and
// bf16's own rounding is the same on both sides. Each part's bf16 gradient
// casts exactly to fp32, and the parts are added in fp32 (reduce_dtype):
// reordered_sum_bound(Σ|parts|, n, fp32) = 4 n 2^-24 Σ|parts|, n the ranks.
// The fp32 shards then step AdamW in fp32: AdamWBound of that bound.
#include <gtest/gtest.h>

#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, Bf16MixedPrecisionTrainsLikeOneProcess) {
  for (bool fused : {false, true}) {
    SCOPED_TRACE(fused ? "comm_fusion" : "per parameter");
    TrainingCase c;
    c.options.mesh = mesh_;
    c.options.comm_fusion = fused;
    c.options.mp_policy.param_dtype = at::kBFloat16;
    c.options.mp_policy.reduce_dtype = at::kFloat;
    c.options.mp_policy.output_dtype = at::kFloat;
    c.compute_dtype = at::kBFloat16;
    expect_training_matches(c);
  }
}

}  // namespace
}  // namespace hp::cuda_test
