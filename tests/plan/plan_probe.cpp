// plan_probe: a diagnostic for the memory plan (P2), not a test. It takes
// hp-train's flags, builds the model and its parallelism as hp-train does,
// prints rank 0's plan, then runs hp-train's step with the peak read after
// each phase (zero_grad, forward, loss, backward, clip, AdamW), so a plan
// that is off can be traced to the phase whose peak it misses:
//
//   hprun -n 2 build/tests/plan/plan_probe --layers 2 --d 256 --seq 16 --batch 4 --steps 2
//
// Byte tokens (vocabulary 256), drawn at random; the numbers are bytes
// above what was live before the model was built.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "hp/distributed/collectives.h"
#include "hp/distributed/launch_env.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/nn/loss.h"
#include "hp/util/memory_stats.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/dry_run.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/parallelize.h"
#include "tools/hp_train/train_options.h"

using namespace hp::train;

int main(int argc, char** argv) {
  constexpr int64_t kVocab = 256;
  const CommandLine command_line =
      parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  const TrainOptions& o = command_line.options;
  at::set_num_threads(1);
  World world;
  world.launched = hp::dist::started_by_launcher();
  if (world.launched) {
    const hp::dist::LaunchEnv env = hp::dist::read_launch_env();
    world.rank = env.rank;
    world.size = env.world_size;
  }
  const Parallelism parallelism = resolve_parallelism(o, world);
  validate_options(o, parallelism);
  const at::Tensor tokens = torch::randint(0, kVocab, {100000}, torch::kLong);
  hp::enable_memory_tracking();
  const int64_t base = hp::memory_stats().current_bytes;
  auto current = [&] { return hp::memory_stats().current_bytes - base; };
  auto peak = [&] { return hp::memory_stats().peak_bytes - base; };

  const hp::plan::MemoryPlan plan =
      hp::plan::plan_memory(plan_options(o, parallelism, kVocab, world.rank));
  if (world.rank == 0) std::cout << hp::plan::format_plan(plan) << std::endl;

  torch::manual_seed(o.seed);
  TrainModel model = TrainModel::build(o, kVocab);
  const bool distributed = parallelism.mode != hp::plan::ParallelMode::kNone;
  if (distributed) hp::dist::init_process_group();
  std::optional<hp::FSDPModule> fsdp = parallelize(model, parallelism, o);
  torch::optim::AdamW optimizer(
      model.module().parameters(),
      torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(o.weight_decay));
  const int64_t dp_rank = parallelism.dp_rank(world.rank);
  for (int64_t s = 0; s < o.steps; ++s) {
    hp::reset_peak_memory();
    const int64_t start = current();
    if (fsdp) {
      fsdp->zero_grad();
    } else {
      model.module().zero_grad(/*set_to_none=*/true);
    }
    const int64_t zeroed = current();
    Batch batch = batch_for_step(tokens, s, o.batch, o.seq, dp_rank, parallelism.dp_size());
    at::Tensor logits = model(batch.inputs);
    const int64_t forward = peak();
    at::Tensor loss = hp::nn::cross_entropy(logits, batch.targets);
    logits = at::Tensor();
    const int64_t loss_peak = peak();
    loss.backward();
    const int64_t backward = peak();
    if (o.grad_clip > 0) hp::clip_grad_norm_(model.module().parameters(), o.grad_clip);
    const int64_t clip = peak();
    optimizer.step();
    std::cout << fmt::format(
                     "rank {} step {}: start {} after zero_grad {} | peak after forward {} loss {} "
                     "backward {} clip {} optimizer {} | end {}",
                     world.rank, s, start, zeroed, forward, loss_peak, backward, clip, peak(),
                     current())
              << std::endl;
  }
  if (distributed) {
    hp::dist::barrier(*hp::dist::world_group()).wait();
    hp::dist::destroy_process_group();
  }
  return 0;
}
