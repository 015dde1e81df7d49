// Memory of a training step under fully_shard measured with the
// counting allocator, not estimated.
//
// A GPT of 8 equal blocks (each its own unit) with a tiny batch, so that
// activations are negligible next to the parameters. Per rank, the peak of
// a steady-state step (forward, backward, AdamW step; Adam state exists)
// must stay within
//   (parameters + gradients + Adam's two moments) / world size
//   + the unsharded working set of two units (one block's parameters and
//     gradients, twice)
//   + 10 %.
// CTest runs it on 1, 2 and 4 ranks (CMakeLists.txt); every rank prints its
// figures.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include "hp/distributed/collectives.h"
#include "hp/util/memory_stats.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/fsdp/gpt_fixture.h"
#include "tests/support/model_configs.h"

namespace hp {
namespace {

int64_t bytes_of(nn::Module& module) {
  int64_t bytes = 0;
  for (auto& p : module.parameters()) bytes += p.numel() * p.element_size();
  return bytes;
}

// Peak bytes of a steady-state step of an 8-block GPT, and the sizes the
// bounds are made of.
struct StepMemory {
  MemoryStats stats;
  int64_t param_bytes;
  int64_t unit_bytes;
};

StepMemory measure_step(const FullyShardOptions& options, bool prefetch, const char* label) {
  enable_memory_tracking();
  const int64_t world = dist::get_world_size(), rank = dist::get_rank();
  const nn::GPTConfig config = test::gpt_config(
      {/*vocab=*/256, /*context=*/16, /*layers=*/8, /*heads=*/4, /*width=*/256});
  torch::manual_seed(3);
  nn::GPT model(config);
  const int64_t param_bytes = bytes_of(*model);
  nn::Block first = model->blocks()[0];
  const int64_t unit_bytes = bytes_of(*first);
  FSDPModule root = test::shard_gpt(model, options);
  root.set_implicit_prefetch(prefetch);
  auto opt = test::make_adamw(*model);
  const int64_t batch = 4;  // one sequence of 8 tokens per rank on 4 ranks
  auto step = [&](int s) {
    at::Tensor tokens = test::token_batch(s, batch, 8).remainder(256);
    const int64_t rows = batch / world;
    at::Tensor rows_tokens = tokens.narrow(0, rank * rows, rows);
    at::Tensor loss = nn::cross_entropy(model(rows_tokens.narrow(1, 0, 8)),
                                        rows_tokens.narrow(1, 1, 8));
    loss.backward();
    opt.step();
    opt.zero_grad();
  };
  step(0);  // creates Adam's state
  reset_peak_memory();
  step(1);
  const MemoryStats stats = memory_stats();
  std::printf("memory %s rank %lld/%lld: peak %.2f MB, steady %.2f MB; unsharded "
              "params+grads+adam %.2f MB, one unit %.2f MB\n",
              label, static_cast<long long>(rank), static_cast<long long>(world),
              stats.peak_bytes / 1e6, stats.current_bytes / 1e6, 4.0 * param_bytes / 1e6,
              unit_bytes / 1e6);
  return {stats, param_bytes, unit_bytes};
}

TEST(FullyShardMemory, PeakOfAStepIsAShardPlusTwoUnits) {
  // The core lifecycle; prefetch deliberately holds one more unit.
  const StepMemory m = measure_step({}, /*prefetch=*/false, "core");
  const double world = dist::get_world_size();
  const double bound = 1.1 * (4.0 * m.param_bytes / world + 2.0 * 2.0 * m.unit_bytes);
  EXPECT_LE(m.stats.peak_bytes, bound) << "bound " << bound / 1e6 << " MB";
}

}  // namespace
}  // namespace hp
