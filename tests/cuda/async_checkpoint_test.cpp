// An asynchronous checkpoint of GPU state (hp/checkpoint/async_save.h):
// the snapshot copies each rank's GPU shards into pinned host staging, so
// the parameters may change as soon as the snapshot is taken (save()'s
// return, or wait_for_staging() when staging in the background), and what
// is written and loaded back is the state at save(), bit for bit: a
// checkpoint stores values, it computes nothing.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "hp/checkpoint/async_save.h"
#include "hp/checkpoint/checkpoint.h"
#include "hp/tensor/dtensor.h"
#include "tests/checkpoint/checkpoint_test_util.h"
#include "tests/cuda/gpt_parity.h"
#include "tests/cuda/on_cuda.h"

namespace hp::cuda_test {
namespace {

TEST_F(OnCuda, AsyncCheckpointOfGpuShardsLoadsBackBitExactly) {
  using checkpoint::Staging;
  for (Staging staging : {Staging::kBeforeReturn, Staging::kInBackground}) {
    const bool background = staging == Staging::kInBackground;
    SCOPED_TRACE(background ? "staged in the background" : "staged before save() returns");
    test::SharedTempDir dir(background ? "cuda_async_bg" : "cuda_async");
    nn::GPT model = make_gpt(device_);
    FullyShardOptions options;
    options.mesh = mesh_;
    FSDPModule root = shard_gpt(model, options);
    checkpoint::State state;
    for (const auto& [key, value] : root.state_dict()) state.add(key, std::get<DTensor>(value));
    std::vector<at::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.detach().clone());

    checkpoint::AsyncCheckpointer checkpointer;
    checkpointer.save(state, dir.path(), /*step=*/1, {}, staging);
    checkpointer.wait_for_staging();
    // The snapshot is taken: overwrite every shard on the GPU while the
    // background thread writes.
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.fill_(-3.0);
    }
    checkpointer.wait();

    checkpoint::load(state, dir.path());
    size_t i = 0;
    for (const auto& p : model->parameters()) {
      EXPECT_TRUE(p.is_cuda());
      EXPECT_TRUE(at::equal(p.detach().cpu(), before[i++].cpu())) << "parameter " << i - 1;
    }
  }
}

}  // namespace
}  // namespace hp::cuda_test
