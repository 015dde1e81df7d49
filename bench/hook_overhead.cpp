// fully_shard's per-unit cost when there is nothing to communicate: a world
// of one (hprun -n 1), a stack of many tiny hookable blocks (Linear w -> w),
// forward + backward, plain vs sharded. The difference per block per step is
// what the hooks, the unit state machine and the (trivial) collectives cost.
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "bench/bench_worker.h"
#include "bench/median.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/nn/module.h"

namespace hp::bench {

namespace {

using Clock = std::chrono::steady_clock;

class TinyBlockImpl : public nn::Module {
 public:
  explicit TinyBlockImpl(int64_t width) : nn::Module("TinyBlock") {
    fc = register_module("fc", torch::nn::Linear(width, width));
  }
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
HP_MODULE(TinyBlock);

class TinyStackImpl : public nn::Module {
 public:
  TinyStackImpl(int64_t units, int64_t width) : nn::Module("TinyStack") {
    list = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < units; ++i) {
      blocks.emplace_back(width);
      list->push_back(blocks.back().ptr());
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = x;
    for (auto& block : blocks) y = block(y);
    return y;
  }
  torch::nn::ModuleList list{nullptr};
  std::vector<TinyBlock> blocks;
};
HP_MODULE(TinyStack);

struct Variant {
  std::string name;
  TinyStack model{nullptr};
  std::optional<FSDPModule> root;
  std::vector<double> times;
};

}  // namespace

int run_hook_worker(const BenchConfig& c) {
  at::set_num_threads(1);
  dist::init_process_group();
  const int world = dist::get_world_size();

  std::vector<Variant> variants(3);
  variants[0].name = "plain";
  variants[1].name = "fully_shard";
  variants[2].name = "fully_shard_comm_fusion";
  for (size_t v = 0; v < variants.size(); ++v) {
    torch::manual_seed(c.seed);
    variants[v].model = TinyStack(c.hook_units, c.hook_width);
    if (v == 0) continue;
    FullyShardOptions options;
    options.comm_fusion = v == 2;
    for (auto& block : variants[v].model->blocks) fully_shard(block.ptr(), options);
    variants[v].root = fully_shard(variants[v].model.ptr(), options);
  }
  torch::manual_seed(c.seed + 1);
  const at::Tensor x = torch::randn({c.hook_batch, c.hook_width});

  auto run = [&](Variant& v, bool timed) {
    const auto t0 = Clock::now();
    at::Tensor out = v.model(x);
    out.sum().backward();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (timed) v.times.push_back(seconds);
    // Outside the timed region, alike for both: fresh gradients next step.
    if (v.root) {
      v.root->zero_grad();
    } else {
      v.model->zero_grad(/*set_to_none=*/true);
    }
  };
  for (auto& v : variants) {
    for (int i = 0; i < 20; ++i) run(v, false);
  }
  // Interleaved chunks: machine load drifts alike over every variant. The
  // overhead is the median over chunks of (variant's chunk median - plain's
  // chunk median), so each difference pairs measurements taken moments apart.
  const int64_t chunk = 10;
  std::vector<std::vector<double>> chunk_medians(variants.size());
  dist::reset_comm_stats();
  for (int64_t done = 0; done < c.hook_steps; done += chunk) {
    for (size_t v = 0; v < variants.size(); ++v) {
      const size_t before = variants[v].times.size();
      for (int64_t i = 0; i < std::min(chunk, c.hook_steps - done); ++i) run(variants[v], true);
      chunk_medians[v].push_back(median(std::vector<double>(
          variants[v].times.begin() + static_cast<std::ptrdiff_t>(before), variants[v].times.end())));
    }
  }
  const dist::CommStats stats = dist::comm_stats();

  const double plain = median(variants[0].times);
  const double plain_min = *std::min_element(variants[0].times.begin(), variants[0].times.end());
  const double units = static_cast<double>(c.hook_units);
  nlohmann::json out;
  out["world_size"] = world;
  out["units"] = c.hook_units;
  out["unit"] = nlohmann::json::object(
      {{"module", "Linear"}, {"in", c.hook_width}, {"out", c.hook_width}});
  out["batch"] = c.hook_batch;
  out["steps"] = c.hook_steps;
  out["what"] = "forward + backward of a stack of tiny hookable blocks; fully_shard on each "
                "block then on the root (which holds no parameters of its own). "
                "overhead_us_per_unit_per_step = median over chunks of 10 interleaved steps of "
                "(chunk median - plain's chunk median) / blocks; from_min: (min step - plain's "
                "min step) / blocks";
  out["plain_step_us"] = plain * 1e6;
  out["plain_min_step_us"] = plain_min * 1e6;
  nlohmann::json variants_json = nlohmann::json::object();
  for (size_t v = 1; v < variants.size(); ++v) {
    std::vector<double> diffs;
    for (size_t k = 0; k < chunk_medians[v].size(); ++k) {
      diffs.push_back(chunk_medians[v][k] - chunk_medians[0][k]);
    }
    const double t = median(variants[v].times);
    const double t_min = *std::min_element(variants[v].times.begin(), variants[v].times.end());
    variants_json[variants[v].name] = {
        {"step_us", t * 1e6},
        {"min_step_us", t_min * 1e6},
        {"overhead_us_per_step", median(diffs) * 1e6},
        {"overhead_us_per_unit_per_step", median(diffs) * 1e6 / units},
        {"overhead_us_per_unit_per_step_from_min", (t_min - plain_min) * 1e6 / units}};
  }
  out["variants"] = variants_json;
  // A world of one: the units' collectives complete locally, without Gloo.
  out["collectives_timed_total_both_sharded_variants"] = stats.total();
  if (dist::get_rank() == 0) std::cout << kResultMarker << out.dump() << std::endl;
  dist::destroy_process_group();
  return 0;
}

}  // namespace hp::bench
