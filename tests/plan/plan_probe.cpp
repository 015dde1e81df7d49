// Diagnostic probe: runs hp-train's step with the peak read after each phase.
#include <ATen/Parallel.h>
#include <torch/torch.h>
#include <fmt/format.h>
#include <iostream>

#include "hp/dist/launch_env.h"
#include "hp/dist/world.h"
#include "hp/dist/collectives.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/memory_stats.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/parallelize.h"
#include "tools/hp_train/train_options.h"
#include "tools/hp_train/dry_run.h"

using namespace hp::train;

int main(int argc, char** argv) {
  const CommandLine cl = parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  const TrainOptions& o = cl.options;
  at::set_num_threads(1);
  World world;
  world.launched = hp::dist::started_by_launcher();
  if (world.launched) {
    auto env = hp::dist::read_launch_env();
    world.rank = env.rank;
    world.size = env.world_size;
  }
  Parallelism par = resolve_parallelism(o, world);
  validate_options(o, par);
  at::Tensor tokens = torch::randint(0, 256, {100000}, torch::kLong);
  hp::enable_memory_tracking();
  const int64_t base = hp::memory_stats().current_bytes;
  hp::nn::GPTConfig config;
  config.vocab_size = 256;
  config.context = o.ctx;
  config.n_layer = o.layers;
  config.n_head = o.heads;
  config.n_embd = o.d;
  torch::manual_seed(o.seed);
  hp::nn::GPT model(config);
  if (par.mode != Mode::kNone) hp::dist::init_process_group();
  auto fsdp = parallelize(model, par, o);
  auto after_shard = hp::memory_stats().current_bytes - base;
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).eps(1e-8).weight_decay(o.weight_decay));
  const int64_t dp_rank = par.dp_size > 1 ? world.rank : 0;
  std::cout << fmt::format("rank {} after shard {}\n", world.rank, after_shard);
  auto plan = hp::plan::plan_memory(plan_options(o, par, 256, world.rank));
  if (world.rank == 0) std::cout << hp::plan::format_plan(plan) << std::endl;
  for (int64_t s = 0; s < o.steps; ++s) {
    hp::reset_peak_memory();
    auto cur = [&] { return hp::memory_stats().current_bytes - base; };
    auto pk = [&] { return hp::memory_stats().peak_bytes - base; };
    int64_t start = cur();
    if (fsdp) fsdp->zero_grad(); else model->zero_grad(true);
    int64_t after_zero = cur();
    Batch b = batch_for_step(tokens, s, o.batch, o.seq, dp_rank, par.dp_size);
    at::Tensor logits = model(b.inputs);
    int64_t fwd_peak = pk(), fwd_cur = cur();
    at::Tensor loss = hp::nn::cross_entropy(logits, b.targets);
    logits = at::Tensor();
    int64_t loss_peak = pk(), loss_cur = cur();
    loss.backward();
    int64_t bwd_peak = pk(), bwd_cur = cur();
    if (o.grad_clip > 0) hp::clip_grad_norm_(model->parameters(), o.grad_clip);
    int64_t clip_peak = pk();
    opt.step();
    int64_t opt_peak = pk(), opt_cur = cur();
    std::cout << fmt::format("rank {} step {} start {} zero {} | fwd pk {} cur {} | loss pk {} cur {} | bwd pk {} cur {} | clip pk {} | opt pk {} cur {}\n",
        world.rank, s, start, after_zero, fwd_peak, fwd_cur, loss_peak, loss_cur, bwd_peak, bwd_cur, clip_peak, opt_peak, opt_cur);
  }
  if (par.mode != Mode::kNone) { hp::dist::barrier(*hp::dist::world_group()).wait(); hp::dist::destroy_process_group(); }
}
