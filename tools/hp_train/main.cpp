// hp-train, the main job (A1): a GPT or a Llama (--model) trained with AdamW on a real
// corpus, in one process or on the ranks of a launcher with FSDP, HSDP or
// DDP, with a progress display, per-step JSON metrics, per-rank peak memory
// and a text sample from the trained model.
//
//   hprun -n 2 build/tools/hp_train/hp-train            # FSDP on 2 ranks
//   hp-train --help                                      # every flag
//
// Order matters: every flag, the corpus and --init-from are checked before
// the process group is joined, so a bad input ends every rank with the same
// message (exit status 2) instead of leaving peers waiting in a collective.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "hp/plan/parallel_layout.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/comm_stats.h"
#include "hp/distributed/launch_env.h"
#include "hp/distributed/world.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/error.h"
#include "hp/util/host_memory.h"
#include "hp/util/memory_stats.h"
#include "hp/util/trace.h"
#include "hp/checkpoint/checkpoint.h"
#include "tools/hp_train/checkpointing.h"
#include "tools/hp_train/corpus.h"
#include "tools/hp_train/dry_run.h"
#include "tools/hp_train/gathered_for_inference.h"
#include "tools/hp_train/init_weights.h"
#include "tools/hp_train/model_flops.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/output_file.h"
#include "tools/hp_train/parallelize.h"
#include "tools/hp_train/pipeline_run.h"
#include "tools/hp_train/progress.h"
#include "tools/hp_train/startup.h"
#include "tools/hp_train/report.h"
#include "tools/hp_train/step_log.h"
#include "tools/hp_train/train_options.h"
#include "tools/hp_train/train_device.h"
#include "tools/hp_train/trainer.h"

namespace {

using namespace hp::train;

constexpr int kExitUsage = 2;

World read_world() {
  World world;
  world.launched = hp::dist::started_by_launcher();
  if (!world.launched) return world;
  const hp::dist::LaunchEnv env = hp::dist::read_launch_env();
  world.rank = env.rank;
  world.size = env.world_size;
  return world;
}

int64_t parameter_count(const TrainModel& model) {
  int64_t count = 0;
  for (const auto& p : model.module().parameters()) count += p.numel();
  return count;
}

void say(bool root, const std::string& text) {
  if (root) std::cout << text << std::endl;
}

// What the plan of a GPU step leaves out (docs/gpu.md has the check).
constexpr const char* kCudaPlanNote =
    "on a GPU this predicts the caching allocator's allocated peak (the step's tensors are "
    "the same; its 512-byte rounding adds under 512 bytes a tensor); not planned: cuBLAS and "
    "cuDNN workspaces and kernel temporaries (on an H100 the measured peak of four runs of a "
    "12 x 1024 GPT was 3.6% to 9.5% above the plan), the allocator's cached segments "
    "(reserved beyond allocated), the CUDA context and NCCL's buffers";

// --dry-run: the plan is arithmetic, so every rank prints its own and rank 0
// writes every rank's JSON line without asking the others; no process group
// is joined.
int dry_run(const TrainOptions& options, const Parallelism& parallelism, const World& world,
            int64_t vocab_size) {
  const bool root = world.rank == 0;
  std::ofstream json;
  if (root && !options.log_json.empty()) json = open_output_file("--log-json", options.log_json);
  for (int r = 0; r < world.size; ++r) {
    // Under --pp, each rank's stages and the micro-batches its schedule
    // keeps in flight (docs/pipeline.md, "Memory plan").
    std::string header = fmt::format("{}, {} x {} tokens per rank", parallelism.describe(),
                                     options.batch / parallelism.dp_size(), options.seq);
    hp::plan::MemoryPlan plan;
    if (options.pp > 1) {
      const hp::plan::PipelinePlanOptions pipeline =
          pipeline_plan_options(options, parallelism, vocab_size, r);
      const hp::plan::PipelineMemoryPlan planned = hp::plan::plan_pipeline_memory(pipeline);
      plan = planned.plan;
      plan.rank = r;
      const int64_t dp = parallelism.dp_size();
      const int64_t tp = parallelism.tp_size();  // 1 without a tp dim
      header = fmt::format(
          "{} pipeline over {} ranks{}{}, {} micro-batches of {} x {} tokens\npipeline {}",
          options.pp_schedule, options.pp,
          dp > 1 ? fmt::format(" x {} data-parallel ranks ({})", dp,
                               hp::plan::mode_name(parallelism.mode))
                 : std::string(),
          tp > 1 ? fmt::format(" x {} tensor-parallel ranks per stage", tp) : std::string(),
          pipeline.schedule.microbatches,
          pipeline.plan.batch_per_rank / pipeline.schedule.microbatches, options.seq,
          hp::plan::describe_pipeline_rank(pipeline, planned));
    } else {
      plan = hp::plan::plan_memory(plan_options(options, parallelism, vocab_size, r));
    }
    if (r == world.rank) {
      std::cout << header << "\n" << hp::plan::format_plan(plan) << std::endl;
      if (options.device == "cuda") std::cout << kCudaPlanNote << std::endl;
    }
    if (json.is_open()) json << plan_json(plan) << "\n";
  }
  if (json.is_open()) say(root, fmt::format("memory plans written to {}", options.log_json));
  return 0;
}

// The header's device line: where rank 0 computes, and the MFU's basis.
std::string device_line(const TrainDevice& device, int world_size) {
  if (!device.is_cuda()) return "cpu";
  return fmt::format(
      "cuda, one GPU per rank (rank 0: {}, GPU {}{}); {}", device.card, device.device.index(),
      world_size > 1 ? ", the others LOCAL_RANK's" : "",
      device.peak_flops ? fmt::format("MFU against a dense bf16 peak of {:.0f} TFLOP/s per GPU",
                                      *device.peak_flops / 1e12)
                        : "no MFU: this card's bf16 peak is not known, give --peak-tflops");
}

int run(TrainOptions options) {
  at::set_num_threads(options.threads);
  // What one step frees, the next reuses instead of faulting it in again
  // (hp/util/host_memory.h); HP_RETAIN_HOST_MEMORY=0 leaves malloc alone.
  hp::retain_freed_host_memory();

  // --- everything that can be wrong with the input, before any collective ---
  const World world = read_world();
  const Parallelism parallelism = resolve_parallelism(options, world);
  validate_options(options, parallelism);
  validate_checkpoint_options(options, parallelism);
  // cpu or cuda, from here on resolved: parallelize builds its meshes there.
  // A plan is arithmetic: planning a GPU run needs no GPU.
  options.device = options.dry_run && options.device == "cuda" ? options.device
                                                                 : resolve_device_type(options);
  // Loaded before memory tracking starts: the token stream is the same on
  // every rank in every mode (fortunes: 2.6M int64 tokens, 20 MiB) and would
  // bury what the modes differ in, the model's share of each rank.
  const Corpus corpus = options.data_file.empty()
                            ? load_fortunes()
                            : load_token_file(options.data_file, options.vocab);
  validate_corpus(options, corpus);
  if (options.dry_run) return dry_run(options, parallelism, world, corpus.vocab_size);
  // This rank's GPU becomes the current device before anything is
  // allocated on one.
  const TrainDevice device = select_device(options, world);
  if (options.pp > 1) return run_pipeline(options, parallelism, world, corpus, device);
  // From here on every libtorch allocation is counted: weights, their
  // shards, gradients, AdamW state, activations, communication buffers.
  // Each training step resets the peak (Trainer::step).
  hp::enable_memory_tracking();

  // The same seed on every rank: identical weights before sharding (or, on
  // meta, identical draws into each rank's shards).
  torch::manual_seed(options.seed);
  const bool meta_init = uses_meta_init(options, parallelism);
  const int64_t before_model_bytes = resident_bytes();
  TrainModel model = build_model(options, corpus.vocab_size, meta_init);
  // Built on the host (the same values as a CPU run), then moved whole; on
  // meta, each rank's shards are materialised on its GPU below.
  if (device.is_cuda() && !meta_init) model.module().to(device.device);
  const std::optional<ResumePoint> resume_point =
      find_resume_point(options, model, /*say=*/world.rank == 0);
  prepare_save_dir(options);
  const int64_t parameters = parameter_count(model);

  const bool root = world.rank == 0;
  std::unique_ptr<StepLog> step_log;
  if (root && !options.log_json.empty()) {
    step_log = std::make_unique<StepLog>(options.log_json, resume_point ? resume_point->step : 0);
  }
  // Written after the last step, so its path is tried now.
  const std::string trace_file =
      options.trace.empty() ? std::string() : trace_path(options.trace, world.rank);
  if (!trace_file.empty()) open_output_file("--trace", trace_file);

  // --- communication starts here ---
  const bool distributed = parallelism.mode != hp::plan::ParallelMode::kNone;
  if (distributed) hp::dist::init_process_group();
  // The ranks resume from one checkpoint or not at all; then --save-dir
  // becomes this job's (a second job sharing it stops here, naming this
  // one), and what crashed saves left there is made right before the resume
  // reads it (checkpoint.h).
  agree_on_resume_point(resume_point);
  if (!options.save_dir.empty()) hp::checkpoint::claim_root(options.save_dir);
  std::optional<hp::FSDPModule> fsdp = parallelize(model, parallelism, options);
  const std::string init_line = materialize_model(model, options, meta_init, device.device);
  const StartupMemory startup =
      gather_startup_memory(distributed ? hp::dist::world_group().get() : nullptr,
                            before_model_bytes,
                            device.is_cuda() ? std::optional<c10::Device>(device.device)
                                             : std::nullopt);
  if (step_log) {
    step_log->set_startup(startup.peak_bytes, startup.vmhwm_bytes, startup.before_model_bytes,
                          meta_init);
  }
  if (!options.trace.empty()) {
    // Each rank's clock starts with its own process; one origin for all,
    // rank 0's wall clock now, lines the ranks' timelines up.
    at::Tensor origin = torch::tensor({hp::trace::unix_now_us()}, torch::kLong);
    if (distributed) hp::dist::broadcast(*hp::dist::world_group(), origin, 0).wait();
    hp::trace::set_origin(origin.item<int64_t>());
    hp::trace::enable(world.rank, fmt::format("rank {}", world.rank));
    // GPU spans convert to this timeline from here (hp/util/gpu_trace.h).
    if (device.is_cuda()) hp::anchor_cuda_trace(device.device);
  }
  // Data-parallel ranks are the world's ranks in the fully_shard modes;
  // tensor-parallel ranks (of one data-parallel group) read the same samples.
  const int64_t dp_rank = parallelism.dp_rank(world.rank);
  Trainer trainer(model, fsdp, distributed ? hp::dist::world_group() : nullptr, dp_rank,
                  parallelism.dp_size(), corpus.tokens, options, device.device);

  say(root, header_text(options, parallelism, corpus, parameters, device_line(device, world.size)));
  if (!init_line.empty()) say(root, init_line);
  say(root, startup_memory_table(startup, meta_init, parameters));
  ProgressMeter meter(options.steps, options.batch * options.seq);
  if (device.is_cuda() && device.peak_flops) {
    // The model's work for the whole global batch, against every GPU's peak.
    const double flops_per_step =
        training_flops_per_token({parameters, model.embedding_parameter_count(), options.layers,
                                  options.d, options.seq}) *
        static_cast<double>(options.batch * options.seq);
    const double peak = *device.peak_flops * world.size;
    meter.set_mfu_basis(flops_per_step, peak);
    if (step_log) step_log->set_mfu_basis(flops_per_step, peak);
  }
  TrainCheckpoints checkpoints(model, trainer.optimizer(), options);
  trainer.set_before_optimizer_step([&checkpoints] { checkpoints.wait_for_staging(); });
  const TrainCheckpoints::Start beginning = checkpoints.start(resume_point, step_log.get(), meter);
  if (!beginning.line.empty()) say(root, beginning.line);
  const int64_t first_step = beginning.first_step;
  std::vector<int64_t> rank_peaks(world.size, 0);
  std::vector<int64_t> rank_cuda_allocated, rank_cuda_reserved;
  if (device.is_cuda()) {
    rank_cuda_allocated.assign(world.size, 0);
    rank_cuda_reserved.assign(world.size, 0);
  }
  double first_loss = 0, last_loss = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t s = first_step; s < options.steps; ++s) {
    StepRecord record;
    {
      hp::trace::Span span(fmt::format("step {}", s), "step", "step");
      record = trainer.step(s);
    }
    for (size_t r = 0; r < rank_peaks.size(); ++r) {
      rank_peaks[r] = std::max(rank_peaks[r], record.rank_peak_bytes.at(r));
      if (device.is_cuda()) {
        rank_cuda_allocated[r] = std::max(rank_cuda_allocated[r], record.rank_cuda_peak_allocated.at(r));
        rank_cuda_reserved[r] = std::max(rank_cuda_reserved[r], record.rank_cuda_peak_reserved.at(r));
      }
    }
    if (s == first_step) first_loss = record.loss;
    last_loss = record.loss;
    meter.record(record.step_time_s);
    if (step_log) step_log->write(record);
    const bool due = s == 0 || (s + 1) % options.log_every == 0 || s + 1 == options.steps;
    if (due) {
      std::optional<std::pair<int64_t, int64_t>> gpu_peaks;
      if (device.is_cuda()) {
        gpu_peaks.emplace(*std::max_element(record.rank_cuda_peak_allocated.begin(),
                                            record.rank_cuda_peak_allocated.end()),
                          *std::max_element(record.rank_cuda_peak_reserved.begin(),
                                            record.rank_cuda_peak_reserved.end()));
      }
      say(root, meter.line(record.loss, gpu_peaks));
    }
    if (checkpoints.due(s + 1)) {
      const std::string line = checkpoints.save(s + 1);
      if (!line.empty()) say(root, line);
    }
  }
  if (const std::string line = checkpoints.finish(); !line.empty()) say(root, line);
  if (!options.export_path.empty()) say(root, export_weights(model, options));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (!options.trace.empty()) {
    hp::trace::disable();
    hp::trace::write(trace_file);
    std::cout << fmt::format("trace of rank {} written to {}", world.rank, trace_file)
              << std::endl;
  }
  if (step_log) say(root, fmt::format("step log written to {}", options.log_json));
  say(root, memory_table(rank_peaks, parameters, rank_cuda_allocated, rank_cuda_reserved));
  double sample_seconds = 0;
  if (options.sample_tokens > 0) {
    say(root, fmt::format("sampling {} from the trained model...",
                          plural(options.sample_tokens, "token")));
    const auto sample_start = std::chrono::steady_clock::now();
    const int64_t gathers_before = hp::dist::comm_stats()[hp::dist::OpType::kAllGather];
    at::Tensor sample;
    {
      // Every rank generates: the units gather their parameters in the first
      // forward, collectively, and keep them for the other tokens. Same
      // generator seed and same logits on every rank, so the ranks draw the
      // same tokens.
      // Tensor parallelism: sampling (top-k, multinomial) has no sharding
      // rules, so every rank samples from a whole copy of the model.
      const bool tensor_parallel = parallelism.tensor_parallel();
      std::optional<GatheredForInference> gathered;
      if (fsdp && !tensor_parallel) {
        gathered.emplace(fully_shard_units(model, *fsdp));
      }
      TrainModel sampler = tensor_parallel ? model.whole_copy() : model;
      if (tensor_parallel) sampler.module().to(device.device);
      sampler.module().eval();
      at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
      // The draws come from a CPU generator on every device: one seed, the
      // same tokens on every rank.
      at::Tensor prompt = corpus.tokens.narrow(0, 0, 1).view({1, 1}).to(device.device);
      sample = sampler.generate(prompt, options.sample_tokens, options.temperature,
                                 options.top_k, generator);
    }
    sample_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sample_start).count();
    const int64_t gathers = hp::dist::comm_stats()[hp::dist::OpType::kAllGather] - gathers_before;
    say(root, fmt::format("sample ({} after the corpus's first token, temperature {:g}, top-k {}; "
                          "{:.1f} s{}):\n{}",
                          plural(options.sample_tokens, "token"), options.temperature,
                          options.top_k, sample_seconds,
                          fsdp ? fmt::format(", {} to gather the parameters",
                                             plural(gathers, "all-gather"))
                               : "",
                          render_tokens(sample[0].cpu(), corpus.vocab_size)));
  }
  say(root, final_line(first_loss, last_loss, first_step, options.steps, seconds,
                       options.batch * options.seq, sample_seconds));
  if (distributed) {
    // Rank 0 hosts the rendezvous store: nobody leaves before all are done.
    hp::dist::barrier(*hp::dist::world_group()).wait();
    hp::dist::destroy_process_group();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const CommandLine command_line =
        parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
    if (command_line.help_requested) {
      fmt::print("{}", command_line.help_text);
      return 0;
    }
    return run(command_line.options);
  } catch (const hp::ArgumentError& e) {
    fmt::print(stderr, "hp-train: error: {}\n", e.what());
    return kExitUsage;
  } catch (const std::exception& e) {
    // Without the C++ backtrace a c10::Error carries.
    fmt::print(stderr, "hp-train: {}\n", hp::exception_message(e));
    return 1;
  }
}
