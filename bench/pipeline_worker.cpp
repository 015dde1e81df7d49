// One pipeline row of hp-bench (pp4, pp4_gpipe, pp4_interleaved,
// pp4_zero_bubble, dp2_pp2), in its own 4 processes: the pipeline as
// hp-train --pp runs it (tools/hp_train/pipeline_run.cpp; dp2_pp2 as
// hp-train --pp 2 --mode fsdp on 4 ranks), timed as bench_worker.cpp times
// the other GPT rows.
//
// Each rank cuts its stages from the whole GPT built on meta (pp_layers
// blocks, cut by --pp-split: even by default, or hp-train's balanced plan)
// and initialises them alone with
// the whole model's draws, so every rank holds the eager model's values, the
// other rows' weights from the same seed. A step (timed, no barrier): drop the
// gradients, every rank reads the one shared batch, Pipeline::step over
// GroupTransport on the world group, AdamW (no clipping, as the other rows).
// dp2_pp2: the ranks are a (dp, pp) = (2, 2) mesh; each stage is
// fully_shard'ed over dp once initialised (every block a unit, the stage the
// root: docs/pipeline.md "fully_shard and tensor parallelism inside stages";
// comm fusion on, as hp-train's fsdp stages),
// the pipeline runs over the pp group, and replica r reads its half of the
// batch (batch_for_step's rank r of 2) in half of the micro-batches.
// The executor's per-step stats (Pipeline::record_step_stats) give each
// rank's compute time, from which the driver computes the measured bubble
// (bench/pipeline_bubble.h). Everything the benchmark itself communicates is
// gathered once after the timed steps.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>

#include "bench/bench_worker.h"
#include "bench/median.h"
#include "bench/rows.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/materialize.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/optim/fused_adamw.h"
#include "hp/pp/lower.h"
#include "hp/pp/pipeline.h"
#include "hp/pp/simulate.h"
#include "hp/pp/stage_plan.h"
#include "hp/util/error.h"
#include "hp/util/host_memory.h"
#include "hp/util/memory_stats.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/corpus.h"
#include "tools/hp_train/startup.h"

namespace hp::bench {

namespace {

// The first block of each stage but the first under --pp-split: none for
// "balanced" (plan_stages's own), else the blocks dealt out evenly, earlier
// stages taking one more where they do not divide
// (bench_config.h, BenchConfig::pp_split).
std::vector<std::string> split_points(const pp::ModelLayout& layout, int stages,
                                      const std::string& how) {
  if (how == "balanced") return {};
  const int blocks = static_cast<int>(layout.blocks.size());
  std::vector<std::string> points;
  int first = 0;
  for (int s = 0; s + 1 < stages; ++s) {
    first += blocks / stages + (s < blocks % stages ? 1 : 0);
    points.push_back(layout.blocks.at(first));
  }
  return points;
}

using Clock = std::chrono::steady_clock;

rusage process_usage() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage;
}

double seconds(const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; }

// The simulator's bubble for the schedule with equal costs (t_F = t_I =
// t_W = 1, free links): mean idle time over the ranks / the makespan.
double simulated_bubble(const pp::ScheduleSpec& spec) {
  const pp::SimResult sim = pp::simulate(spec, pp::lower(spec, pp::compute_rows(spec)));
  if (sim.deadlock || sim.makespan <= 0) return std::nan("");
  double idle = 0;
  for (double v : sim.idle) idle += v;
  return idle / static_cast<double>(sim.idle.size()) / sim.makespan;
}

}  // namespace

int run_pipeline_worker(const std::string& row, const BenchConfig& c) {
  const PipelineRow* pp_row = pipeline_row(find_row_spec(row));
  HP_CHECK_ARG(pp_row != nullptr && row.rfind("torch_", 0) != 0, "--worker ", row,
               " is not a pipeline row of ours");
  HP_CHECK_ARG(c.device == "cpu", "--worker ", row, " runs on the CPU only (got --device ",
               c.device, ")");
  at::set_num_threads(1);
  hp::retain_freed_host_memory();  // as hp-train does
  const train::Corpus corpus = train::load_token_file(c.tokens_path, c.vocab);
  dist::init_process_group();
  const int rank = dist::get_rank(), world = dist::get_world_size();
  const int replicas = pp_row->data_parallel;
  HP_CHECK_ARG(world % replicas == 0, "--worker ", row, " runs on a multiple of ", replicas,
               " ranks, not ", world);
  const int pp_ranks = pp_row->pipeline_ranks(world);
  const pp::ScheduleSpec spec{pp::parse_schedule_kind(pp_row->schedule), pp_ranks,
                              pp_row->stages_per_rank, static_cast<int>(pp_row->microbatches(c))};
  pp::check_spec(spec);
  // (dp, pp), row-major as hp-train's: the pp ranks of one replica adjacent.
  DeviceMeshPtr mesh;
  if (replicas > 1) mesh = init_device_mesh("cpu", {replicas, pp_ranks}, {"dp", "pp"});
  const int replica = mesh ? static_cast<int>(mesh->coordinate(0)) : 0;
  const int pipeline_rank = mesh ? static_cast<int>(mesh->coordinate(1)) : rank;

  enable_memory_tracking();
  const int64_t rss_before_model = train::resident_bytes();
  // The stages of this rank, cut from the whole model on meta and
  // initialised one by one from the generator state after the whole model's
  // constructors (which the meta build made), as hp-train --pp does.
  const nn::GPTConfig config = c.gpt_config(c.pp_layers, c.d);
  torch::manual_seed(c.seed);
  nn::GPT whole(config, c10::Device(c10::kMeta));
  const pp::ModelLayout layout = pp::gpt_layout(config);
  const pp::StagePlan plan =
      pp::plan_stages(layout, pp::num_stages(spec),
                      split_points(layout, pp::num_stages(spec), c.pp_split));
  const nn::InitPlan whole_init = whole->init_plan();
  int64_t parameters = 0;
  for (const auto& p : whole->parameters()) parameters += p.numel();
  int64_t block_bytes = 0;
  for (const auto& p : whole->blocks().at(0)->parameters()) block_bytes += p.nbytes();
  std::vector<pp::StageModule> stages;
  std::vector<nn::InitPlan> inits;
  for (int s : pp::rank_stages(spec, pipeline_rank)) {
    stages.push_back(pp::gpt_stage(*whole, plan, s));
    inits.push_back(pp::stage_init_plan(*whole, whole_init, *stages.back()));
  }
  whole = nn::GPT(nullptr);
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  const at::Tensor init_state = generator.get_state();
  for (size_t i = 0; i < stages.size(); ++i) {
    generator.set_state(init_state);
    init_sharded(*stages[i], inits[i]);
  }
  if (mesh) {
    FullyShardOptions shard;
    shard.mesh = (*mesh)["dp"];
    // One gather and one reduction per unit, as hp-train's default and as
    // FSDP2 (the library's CPU default is per parameter).
    shard.comm_fusion = true;
    for (const pp::StageModule& stage : stages) {
      for (const auto& block : stage->blocks()) fully_shard(block, shard);
      fully_shard(stage.ptr(), shard);
    }
  }

  pp::Pipeline pipeline({spec, c.d}, stages,
                        std::make_shared<pp::GroupTransport>(mesh ? mesh->group_ptr(1)
                                                                  : dist::world_group()),
                        [](const at::Tensor& logits, const at::Tensor& targets) {
                          return nn::cross_entropy(logits, targets);
                        });
  optim::FusedAdamW optimizer(pipeline.parameters(), torch::optim::AdamWOptions(c.lr)
                                                         .betas({c.beta1, c.beta2})
                                                         .eps(c.eps)
                                                         .weight_decay(c.weight_decay));
  const int last_pipeline_rank = pp::stage_rank(spec, pp::num_stages(spec) - 1);
  const bool has_last = last_pipeline_rank == pipeline_rank;

  auto step = [&](int64_t s) {
    for (auto& stage : stages) stage->zero_grad(/*set_to_none=*/true);
    // Every pipeline rank reads the one batch (stage 0 its ids, the last
    // stage its targets, the others its shape), as hp-train --pp does; each
    // replica its share of it.
    train::Batch batch = train::batch_for_step(corpus.tokens, s, c.batch, c.seq, replica, replicas);
    at::Tensor loss = pipeline.step(batch.inputs, batch.targets);
    optimizer.step();
    return loss;
  };

  double first_loss = std::numeric_limits<double>::quiet_NaN();
  for (int64_t s = 0; s < c.warmup; ++s) {
    at::Tensor loss = step(s);
    if (s == 0 && has_last) first_loss = loss.item<double>();
  }

  // --- the measured region: nothing but training steps ---
  dist::reset_comm_stats();
  reset_peak_memory();
  pipeline.record_step_stats(true);
  const rusage usage_start = process_usage();
  std::vector<double> times, losses, step_faults, compute_s, pipeline_s, wait_s;
  for (int64_t i = 0; i < c.steps; ++i) {
    const long faults_before = process_usage().ru_minflt;  // outside the timed span
    const auto t0 = Clock::now();
    at::Tensor loss = step(c.warmup + i);
    times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    const pp::StepStats& stats = pipeline.last_step_stats();
    compute_s.push_back(stats.compute_s);
    pipeline_s.push_back(stats.step_s);
    wait_s.push_back(stats.wait_s);
    step_faults.push_back(static_cast<double>(process_usage().ru_minflt - faults_before));
    losses.push_back(has_last ? loss.item<double>() : 0.0);
    if (c.warmup == 0 && i == 0 && has_last) first_loss = losses.back();
  }
  const rusage usage_end = process_usage();
  pipeline.record_step_stats(false);
  const dist::CommStats comm = dist::comm_stats();
  const MemoryStats memory = memory_stats();
  const int64_t rss_delta =
      static_cast<int64_t>(usage_end.ru_maxrss) * 1024 - rss_before_model;  // KiB on Linux
  // --- end of the measured region ---

  // Per rank: times, losses, compute, pipeline step, wait (n each), then the scalars.
  const int64_t n = c.steps;
  std::vector<double> mine = times;
  for (const auto* v : {&losses, &compute_s, &pipeline_s, &wait_s})
    mine.insert(mine.end(), v->begin(), v->end());
  mine.push_back(static_cast<double>(memory.peak_bytes));
  mine.push_back(static_cast<double>(rss_delta));
  mine.push_back(static_cast<double>(memory.current_bytes));
  for (dist::OpType op : dist::kOpTypes) mine.push_back(static_cast<double>(comm[op]));
  mine.push_back(comm.comm_seconds);
  mine.push_back(comm.wait_seconds);
  mine.push_back(has_last ? first_loss : 0.0);
  mine.push_back((seconds(usage_end.ru_stime) - seconds(usage_start.ru_stime)) /
                 static_cast<double>(n));
  mine.push_back(median(step_faults));
  double host_s = 0;
  for (double t : times) host_s += t;
  mine.push_back(host_s / static_cast<double>(n));  // on the CPU the host's time is the step
  const int64_t width = static_cast<int64_t>(mine.size());
  at::Tensor all = torch::empty({world * width}, torch::kDouble);
  dist::all_gather_into(*dist::world_group(), all, torch::tensor(mine, torch::kDouble)).wait();
  all = all.view({world, width});

  if (rank == 0) {
    auto at_rank = [&](int r, int64_t i) { return all[r][i].item<double>(); };
    auto series = [&](int r, int64_t block) {
      std::vector<double> v;
      for (int64_t i = 0; i < n; ++i) v.push_back(at_rank(r, block * n + i));
      return v;
    };
    // The loss lives on each replica's last stage's rank; the replicas' mean
    // (equal halves of the batch) is the batch's.
    std::vector<int> last_ranks;
    for (int r = 0; r < replicas; ++r) last_ranks.push_back(r * pp_ranks + last_pipeline_rank);
    auto replicas_mean = [&](int64_t i) {
      double sum = 0;
      for (int r : last_ranks) sum += at_rank(r, i);
      return sum / static_cast<double>(replicas);
    };
    std::vector<double> mean_losses;
    for (int64_t i = 0; i < n; ++i) mean_losses.push_back(replicas_mean(n + i));
    std::vector<double> step_max(n, 0);
    for (int64_t i = 0; i < n; ++i)
      for (int r = 0; r < world; ++r) step_max[i] = std::max(step_max[i], at_rank(r, i));
    std::vector<std::vector<double>> compute_each, pipeline_each, wait_each;
    std::vector<int64_t> peaks, rss, current;
    std::vector<double> comm_s, comm_wait_s, kernel_s, faults, host_each;
    nlohmann::json counts = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
      compute_each.push_back(series(r, 2));
      pipeline_each.push_back(series(r, 3));
      wait_each.push_back(series(r, 4));
      int64_t field = 5 * n;
      peaks.push_back(static_cast<int64_t>(at_rank(r, field++)));
      rss.push_back(static_cast<int64_t>(at_rank(r, field++)));
      current.push_back(static_cast<int64_t>(at_rank(r, field++)));
      nlohmann::json count = nlohmann::json::object();
      for (dist::OpType op : dist::kOpTypes)
        count[dist::op_name(op)] = static_cast<int64_t>(at_rank(r, field++));
      counts.push_back(count);
      comm_s.push_back(at_rank(r, field++));
      comm_wait_s.push_back(at_rank(r, field++));
      ++field;  // the first loss, read from the last stage's rank below
      kernel_s.push_back(at_rank(r, field++));
      faults.push_back(at_rank(r, field++));
      host_each.push_back(at_rank(r, field++));
    }
    const double first = replicas_mean(width - 4);
    nlohmann::json out;
    out["row"] = row;
    out["ranks"] = world;
    out["mesh"] = mesh ? mesh->shape() : std::vector<int64_t>{world};
    out["mesh_names"] = mesh ? mesh->dim_names() : std::vector<std::string>{"pp"};
    out["comm_fusion"] = mesh != nullptr;
    out["prefetch"] = false;
    out["activation_checkpointing"] = false;
    out["threads"] = at::get_num_threads();
    out["parameters"] = parameters;
    out["block_param_bytes"] = block_bytes;
    out["steps"] = n;
    out["warmup"] = c.warmup;
    out["step_times_s"] = step_max;
    out["losses"] = mean_losses;
    out["first_loss"] = std::isnan(first) ? nlohmann::json(nullptr) : nlohmann::json(first);
    out["peak_bytes_per_rank"] = peaks;
    out["end_bytes_per_rank"] = current;
    out["peak_rss_delta_bytes_per_rank"] = rss;
    out["collective_counts_per_rank"] = counts;
    out["comm_seconds_per_rank"] = comm_s;
    out["wait_seconds_per_rank"] = comm_wait_s;
    out["kernel_s_per_step_per_rank"] = kernel_s;
    out["page_faults_per_step_per_rank"] = faults;
    out["host_s_per_step_per_rank"] = host_each;
    out["units"] = c.pp_layers + 1;  // as the other rows count them: the blocks and the root
    out["device"] = c.device;
    out["pipeline"] = {
        {"schedule", pp_row->schedule},
        {"stages_per_rank", spec.stages_per_rank},
        {"microbatches", spec.microbatches},
        {"data_parallel", replicas},
        {"layers", c.pp_layers},
        {"split", c.pp_split},
        {"stage_plan", pp::describe(plan)},
        {"compute_s_per_rank_per_step", compute_each},
        {"step_s_per_rank_per_step", pipeline_each},
        {"wait_s_per_rank_per_step", wait_each},
        {"theoretical_bubble", pp::theoretical_bubble(spec)},
        {"simulated_bubble", simulated_bubble(spec)},
        {"bubble_method",
         "hp::pp::Pipeline::record_step_stats: per rank and step, 1 - (wall time inside the "
         "compute actions F (with the loss), B, I, W, minus their waits for received inputs and "
         "gradients) / (wall time of Pipeline::step); mean over steps, then ranks"}};
    std::cout << kResultMarker << out.dump() << std::endl;
  }
  // Rank 0 hosts the rendezvous store: nobody leaves before all are done.
  dist::barrier(*dist::world_group()).wait();
  dist::destroy_process_group();
  return 0;
}

}  // namespace hp::bench
