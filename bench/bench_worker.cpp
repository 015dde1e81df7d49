// One GPT row of hp-bench, in its own process(es).
//
// Per step (timed, no barrier): drop the gradients, slice this rank's batch,
// forward, cross-entropy, backward, AdamW. Everything the benchmark itself
// communicates (the per-step times, losses, peaks) is gathered once after the
// timed steps, after the communication counters have been read, so neither
// the times nor the counters include it.
#include "bench/bench_worker.h"

#include <ATen/Parallel.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "bench/median.h"
#include "bench/op_compare.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/optim/fused_adamw.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/plan/parallel_layout.h"
#include "hp/util/cuda_memory.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"
#include "hp/util/host_memory.h"
#include "hp/util/memory_stats.h"
#include "hp/util/op_profile.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/corpus.h"
#include "tools/hp_train/dry_run.h"
#include "tools/hp_train/parallelize.h"
#include "tools/hp_train/startup.h"

namespace hp::bench {

namespace {

rusage process_usage() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage;
}

int64_t peak_rss_bytes() {
  return static_cast<int64_t>(process_usage().ru_maxrss) * 1024;  // KiB on Linux
}

double seconds(const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; }

using Clock = std::chrono::steady_clock;

// A row's layout (hp/plan/parallel_layout.h) and the fully_shard options
// it runs with.
struct RowSpec {
  plan::ParallelLayout layout;
  bool fusion = false;
  bool prefetch = true;
  bool activation_checkpointing = false;  // every block (hp-train's "blocks")
};

RowSpec row_spec(const std::string& row, int world) {
  using plan::ParallelLayout;
  using plan::ParallelMode;
  const int64_t n = world;
  // Our DDP buckets its all-reduces: with comm_fusion, one per unit (DDP's
  // buckets); the unbucketed path is the diagnostic row ddp_unfused.
  if (row == "ddp") return {ParallelLayout(ParallelMode::kDDP, {n, 1}), true, true};
  if (row == "ddp_unfused") return {ParallelLayout(ParallelMode::kDDP, {n, 1}), false, true};
  const ParallelLayout fsdp(ParallelMode::kFSDP, {n});
  if (row == "fsdp") return {fsdp, false, false};
  if (row == "fsdp_ac") return {fsdp, false, false, true};
  if (row == "fsdp_prefetch") return {fsdp, false, true};
  if (row == "fsdp_fused") return {fsdp, true, false};
  if (row == "fsdp_fused_prefetch") return {fsdp, true, true};
  // Tensor parallelism: every layer split over the ranks, which all read
  // the same samples (the single row's batch, not one per rank).
  if (row == "tp") return {ParallelLayout(ParallelMode::kTP, {n}), false, false};
  // Tensor parallelism in pairs of ranks, fully_shard over the pairs (with
  // fusion and prefetch, the fastest fully_shard setting).
  if (row == "fsdp_tp") {
    HP_CHECK_ARG(world % 2 == 0, "--worker fsdp_tp needs an even world size, got ", world);
    return {ParallelLayout(ParallelMode::kFSDPTP, {n / 2, 2}), true, true};
  }
  if (row == "hsdp_fused_prefetch") {
    HP_CHECK_ARG(world % 2 == 0, "--worker hsdp_fused_prefetch needs an even world size, got ",
                 world);
    return {ParallelLayout(ParallelMode::kHSDP, hsdp_mesh(world)), true, true};
  }
  throw ArgumentError(cat("--worker ", row, " is not a GPT row of ours; expected one of ",
                          to_string(row_names()), " (but the torch_ rows) or ",
                          to_string(extra_row_names())));
}

}  // namespace

int run_gpt_worker(const std::string& row, const BenchConfig& c) {
  at::set_num_threads(1);
  hp::retain_freed_host_memory();  // as hp-train does
  const bool distributed = row != "single";
  RowSpec spec;
  // Loaded before memory tracking: the token stream is the same everywhere.
  const train::Corpus corpus = train::load_token_file(c.tokens_path, c.vocab);
  if (distributed) dist::init_process_group();
  const int rank = distributed ? dist::get_rank() : 0;
  const int world = distributed ? dist::get_world_size() : 1;
  if (distributed) spec = row_spec(row, world);
  // On a GPU: this local rank's, current before anything is allocated.
  const bool cuda = c.device == "cuda";
  at::Device device = at::kCPU;
  if (cuda) device = distributed ? dist::local_cuda_device() : compat::set_current_cuda_device(0);
  // Mixed precision for the fully_shard rows but DDP (bench_config.h).
  if (distributed && spec.layout.mode != plan::ParallelMode::kDDP) {
    spec.layout.param_dtype = plan::parse_dtype(c.param_dtype, "--param-dtype");
    if (!c.reduce_dtype.empty()) {
      spec.layout.reduce_dtype = plan::parse_dtype(c.reduce_dtype, "--reduce-dtype");
    }
  }

  enable_memory_tracking();
  // Process memory, measured the same way for our rows and PyTorch's.
  const int64_t rss_before_model = train::resident_bytes();
  const nn::GPTConfig config = c.gpt_config(c.layers, c.d);
  torch::manual_seed(c.seed);
  nn::GPT model(config);
  int64_t parameters = 0, block_bytes = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  for (const auto& p : model->blocks().at(0)->parameters()) block_bytes += p.nbytes();
  if (cuda) model->to(device);

  std::optional<FSDPModule> root;
  // hp-train's recipe for this row; also what the memory plan is asked about.
  const plan::ParallelLayout& parallelism = spec.layout;
  train::TrainOptions recipe;
  if (distributed) {
    // hp-train's own recipe (each block a unit, then the root), so the
    // benchmark measures what the training program runs.
    recipe.device = c.device;
    recipe.comm_fusion = spec.fusion;
    recipe.prefetch = spec.prefetch;
    if (spec.activation_checkpointing) recipe.activation_checkpointing = "blocks";
    root = train::parallelize(model, parallelism, recipe);
  }
  // hp-train's optimizer: AdamW, one fused pass per parameter.
  optim::FusedAdamW optimizer(model->parameters(), torch::optim::AdamWOptions(c.lr)
                                                       .betas({c.beta1, c.beta2})
                                                       .eps(c.eps)
                                                       .weight_decay(c.weight_decay));
  const int64_t dp_rank = parallelism.dp_rank(rank), dp_size = parallelism.dp_size();
  const int64_t global_batch = c.batch * dp_size;

  auto step = [&](int64_t s) {
    if (root) {
      root->zero_grad();
    } else {
      model->zero_grad(/*set_to_none=*/true);
    }
    train::Batch batch =
        train::batch_for_step(corpus.tokens, s, global_batch, c.seq, dp_rank, dp_size);
    if (cuda) {
      batch.inputs = batch.inputs.to(device);
      batch.targets = batch.targets.to(device);
    }
    at::Tensor loss = nn::cross_entropy(model(batch.inputs), batch.targets);
    loss.backward();
    optimizer.step();
    return loss.detach();
  };

  double first_loss = std::numeric_limits<double>::quiet_NaN();
  for (int64_t s = 0; s < c.warmup; ++s) {
    at::Tensor loss = step(s);
    if (s == 0) first_loss = loss.item<double>();
  }

  // --- the measured region: nothing but training steps ---
  dist::reset_comm_stats();
  reset_peak_memory();
  // A GPU's step is its GPU time, between two events on the compute
  // stream; its exposed communication the time that stream stood at a
  // collective's wait (hp/distributed/comm_stats.h).
  if (cuda) {
    reset_cuda_peak_memory(device.index());
    dist::set_stream_wait_timing(true);
  }
  OpProfile op_profile;  // --profile-ops: the timed steps' ops, not the warm-up's
  if (!c.profile_ops_dir.empty()) op_profile.start();
  const rusage usage_start = process_usage();
  std::vector<double> times, losses, step_faults;
  double host_s = 0;  // the host's time to issue the timed steps
  for (int64_t i = 0; i < c.steps; ++i) {
    const long faults_before = process_usage().ru_minflt;  // outside the timed span
    const auto t0 = Clock::now();
    std::optional<CudaTimer> gpu;
    if (cuda) {
      gpu.emplace(device);
      gpu->start();
    }
    at::Tensor loss = step(c.warmup + i);
    host_s += std::chrono::duration<double>(Clock::now() - t0).count();
    if (gpu) {
      gpu->stop();
      times.push_back(gpu->seconds());
    } else {
      times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    step_faults.push_back(static_cast<double>(process_usage().ru_minflt - faults_before));
    losses.push_back(loss.item<double>());
    if (c.warmup == 0 && i == 0) first_loss = losses.back();
  }
  const rusage usage_end = process_usage();
  CudaMemoryStats gpu_memory;
  double exposed_s = 0;
  if (cuda) {
    gpu_memory = cuda_memory_stats(device.index());
    exposed_s = dist::stream_wait_seconds();
    dist::set_stream_wait_timing(false);
  }
  std::optional<OpProfileResult> ops;
  if (op_profile.active()) ops = op_profile.stop();
  const dist::CommStats stats = dist::comm_stats();
  const MemoryStats memory = memory_stats();
  const int64_t rss_delta = peak_rss_bytes() - rss_before_model;
  // --- end of the measured region ---
  if (ops) write_ops_file(c.profile_ops_dir, row, rank, c.steps, *ops);

  std::vector<double> mine = times;
  mine.insert(mine.end(), losses.begin(), losses.end());
  for (double v : {static_cast<double>(memory.peak_bytes), static_cast<double>(rss_delta),
                   static_cast<double>(memory.current_bytes)}) {
    mine.push_back(v);
  }
  for (dist::OpType op : dist::kOpTypes) mine.push_back(static_cast<double>(stats[op]));
  for (double v : {stats.comm_seconds, stats.wait_seconds, first_loss}) mine.push_back(v);
  // The whole process (every thread): kernel time per step over the timed
  // steps, and the median step's page faults (what every step pays, not a
  // one-off of the first timed steps).
  mine.push_back((seconds(usage_end.ru_stime) - seconds(usage_start.ru_stime)) /
                 static_cast<double>(c.steps));
  mine.push_back(median(step_faults));
  // The host's time to issue a step, from its start to the return of the
  // step function, before anything waits for the GPU's result (the whole
  // step on the CPU); then the GPU figures (0 on the CPU). Not getrusage's
  // CPU time: a host synchronising with a GPU spins, and that would count.
  mine.push_back(host_s / static_cast<double>(c.steps));
  mine.push_back(static_cast<double>(gpu_memory.peak_allocated_bytes));
  mine.push_back(static_cast<double>(gpu_memory.peak_reserved_bytes));
  mine.push_back(exposed_s);
  const int64_t width = static_cast<int64_t>(mine.size());
  at::Tensor local = torch::tensor(mine, torch::kDouble);
  at::Tensor all = local.view({1, width});
  if (distributed) {
    all = torch::empty({world * width}, torch::kDouble);
    dist::all_gather_into(*dist::world_group(), all, local).wait();
    all = all.view({world, width});
  }

  if (rank == 0) {
    // The memory plan of every rank (P2): arithmetic, no communication. The
    // measured peak spans steps after the warm-up: the plan's steady step.
    recipe.layers = c.layers;
    recipe.d = c.d;
    recipe.heads = c.heads;
    recipe.ctx = c.ctx;
    recipe.seq = c.seq;
    recipe.batch = global_batch;
    recipe.grad_clip = 0;  // the benchmark's step does not clip
    std::vector<int64_t> predicted, in_flight;
    for (int r = 0; r < world; ++r) {
      const plan::MemoryPlan plan =
          plan::plan_memory(train::plan_options(recipe, parallelism, c.vocab, r));
      predicted.push_back(plan.steady.terms.total());
      in_flight.push_back(plan.steady.in_flight_bytes);
    }
    const int64_t n = c.steps;
    auto at_rank = [&](int r, int64_t i) { return all[r][i].item<double>(); };
    nlohmann::json out;
    out["row"] = row;
    out["ranks"] = world;
    out["mesh"] = distributed ? nlohmann::json(parallelism.mesh_shape) : nlohmann::json(nullptr);
    out["mesh_names"] =
        distributed ? nlohmann::json(parallelism.mesh_names) : nlohmann::json(nullptr);
    out["comm_fusion"] = spec.fusion && distributed;
    out["prefetch"] = spec.prefetch && distributed;
    out["activation_checkpointing"] = spec.activation_checkpointing && distributed;
    out["threads"] = at::get_num_threads();
    out["parameters"] = parameters;
    out["block_param_bytes"] = block_bytes;
    out["steps"] = n;
    out["warmup"] = c.warmup;
    std::vector<double> step_max(n, 0), loss_mean(n, 0);
    for (int64_t i = 0; i < n; ++i) {
      for (int r = 0; r < world; ++r) {
        step_max[i] = std::max(step_max[i], at_rank(r, i));
        loss_mean[i] += at_rank(r, n + i) / world;
      }
    }
    out["step_times_s"] = step_max;
    out["losses"] = loss_mean;
    double first = 0;
    std::vector<int64_t> peaks, rss, current;
    std::vector<double> comm_s, wait_s, kernel_s, faults, host_s_each, exposed;
    std::vector<int64_t> cuda_allocated, cuda_reserved;
    nlohmann::json counts = nlohmann::json::array();
    for (int r = 0; r < world; ++r) {
      const int64_t b = 2 * n;
      peaks.push_back(static_cast<int64_t>(at_rank(r, b)));
      rss.push_back(static_cast<int64_t>(at_rank(r, b + 1)));
      current.push_back(static_cast<int64_t>(at_rank(r, b + 2)));
      nlohmann::json count = nlohmann::json::object();
      int64_t field = b + 3;
      for (dist::OpType op : dist::kOpTypes) {
        count[dist::op_name(op)] = static_cast<int64_t>(at_rank(r, field++));
      }
      counts.push_back(count);
      comm_s.push_back(at_rank(r, field));
      wait_s.push_back(at_rank(r, field + 1));
      first += at_rank(r, field + 2) / world;
      kernel_s.push_back(at_rank(r, field + 3));
      faults.push_back(at_rank(r, field + 4));
      host_s_each.push_back(at_rank(r, field + 5));
      cuda_allocated.push_back(static_cast<int64_t>(at_rank(r, field + 6)));
      cuda_reserved.push_back(static_cast<int64_t>(at_rank(r, field + 7)));
      exposed.push_back(at_rank(r, field + 8));
    }
    out["first_loss"] = std::isnan(first) ? nlohmann::json(nullptr) : nlohmann::json(first);
    out["peak_bytes_per_rank"] = peaks;
    // On a GPU the same plan predicts the caching allocator's allocated
    // peak (the step's tensors are the same), which the row reports.
    out["predicted_peak_bytes_per_rank"] = predicted;
    out["predicted_in_flight_bytes_per_rank"] = in_flight;
    out["end_bytes_per_rank"] = current;
    out["peak_rss_delta_bytes_per_rank"] = rss;
    out["collective_counts_per_rank"] = counts;  // over the timed steps
    out["comm_seconds_per_rank"] = comm_s;
    out["wait_seconds_per_rank"] = wait_s;
    out["kernel_s_per_step_per_rank"] = kernel_s;
    out["page_faults_per_step_per_rank"] = faults;
    out["host_s_per_step_per_rank"] = host_s_each;
    out["units"] = c.layers + 1;  // the blocks and the root, fully_shard's units
    out["device"] = c.device;
    if (cuda) {
      out["param_dtype"] = plan::dtype_name(parallelism.param_dtype);
      out["cuda_peak_allocated_bytes_per_rank"] = cuda_allocated;
      out["cuda_peak_reserved_bytes_per_rank"] = cuda_reserved;
      out["exposed_comm_seconds_per_rank"] = exposed;
    }
    std::cout << kResultMarker << out.dump() << std::endl;
  }
  if (distributed) {
    // Rank 0 hosts the rendezvous store: nobody leaves before all are done.
    dist::barrier(*dist::world_group()).wait();
    dist::destroy_process_group();
  }
  return 0;
}

}  // namespace hp::bench
