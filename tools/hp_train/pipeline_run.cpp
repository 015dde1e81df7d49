#include "tools/hp_train/pipeline_run.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/load_into_shards.h"
#include "hp/distributed/collectives.h"
#include "hp/distributed/p2p.h"
#include "hp/distributed/world.h"
#include "hp/fsdp/fully_shard.h"
#include "hp/fsdp/clip_grad.h"
#include "hp/fsdp/materialize.h"
#include "hp/mesh/device_mesh.h"
#include "hp/nn/activation_checkpoint.h"
#include "hp/nn/loss.h"
#include "hp/optim/fused_adamw.h"
#include "hp/plan/parallel_layout.h"
#include "hp/pp/pipeline.h"
#include "hp/pp/pipeline_checkpoint.h"
#include "hp/tensor/dtensor_tensor.h"
#include "hp/tp/shard_module.h"
#include "hp/util/cuda_timer.h"
#include "hp/util/memory_stats.h"
#include "hp/util/trace.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/checkpointing.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/output_file.h"
#include "tools/hp_train/progress.h"
#include "tools/hp_train/report.h"
#include "tools/hp_train/startup.h"
#include "tools/hp_train/step_log.h"
#include "tools/hp_train/trainer.h"

namespace hp::train {

namespace {

// Transfers of the sample's weight gathering: a tag of their own, apart
// from the pipeline's activations and gradients.
constexpr int kWeightTag = 2;

void say(bool root, const std::string& text) {
  if (root) std::cout << text << std::endl;
}

// Copies of this rank's stages' parameters by name, whole: tensor-parallel
// ones gathered over their mesh (collective over the stage's tp ranks,
// every one of them in the same order); call with fully_shard's units
// unsharded (the copies outlive their reshard).
std::map<std::string, at::Tensor> whole_values(const std::vector<pp::StageModule>& stages) {
  std::map<std::string, at::Tensor> values;
  torch::NoGradGuard no_grad;
  for (const auto& stage : stages)
    for (const auto& item : stage->named_parameters())
      // A replicated DTensor's full value is its local tensor: cloned too.
      values[item.key()] =
          (is_dtensor(item.value()) ? full_tensor(item.value()) : item.value()).clone();
  return values;
}

// The whole model on rank 0, its tensors copied from the ranks holding
// them (in the whole model's parameter order; each rank sends `mine`, its
// stages' whole values, rank 0 receives the rest): for sampling. Collective
// over `group`.
TrainModel gather_on_rank0(const TrainOptions& options, int64_t vocab, const pp::StagePlan& plan,
                           const pp::ScheduleSpec& spec,
                           const std::map<std::string, at::Tensor>& mine, dist::Group& group) {
  const int rank = group.rank();
  TrainModel whole = TrainModel::build(options, vocab, rank == 0 ? c10::Device(c10::kCPU)
                                                                 : c10::Device(c10::kMeta));
  std::vector<dist::Work> pending;
  std::vector<at::Tensor> keep;
  torch::NoGradGuard no_grad;
  for (const auto& item : whole.module().named_parameters()) {
    const int owner = pp::stage_rank(spec, plan.stage_of(item.key()));
    if (rank == 0 && owner == 0) {
      item.value().copy_(mine.at(item.key()));
    } else if (rank == 0) {
      pending.push_back(dist::recv(group, item.value(), owner, kWeightTag));
    } else if (owner == rank) {
      keep.push_back(mine.at(item.key()).detach().to(at::kCPU).contiguous());
      pending.push_back(dist::send(group, keep.back(), 0, kWeightTag));
    }
  }
  for (auto& work : pending) work.wait();
  return whole;
}

}  // namespace

int run_pipeline(const TrainOptions& options, const Parallelism& parallelism, const World& world,
                 const Corpus& corpus, const TrainDevice& device) {
  const bool root = world.rank == 0;
  const PipelineSchedule schedule = pipeline_schedule(options);
  // The mesh (dp, pp, tp), row-major: a stage's T tensor-parallel ranks
  // are adjacent, then the P pipeline ranks of one data-parallel rank.
  // Under hsdp the dp dim is (dp_replicate, dp_shard), R x S: the same
  // global ranks, data-parallel index r * S + s.
  const int64_t replicas = parallelism.dp_size();
  const int64_t tp = parallelism.tp_size();  // 1 without a tp dim
  const int replica = static_cast<int>(world.rank / (schedule.ranks * tp));
  const int pipeline_rank = static_cast<int>(world.rank / tp % schedule.ranks);
  const int tp_rank = static_cast<int>(world.rank % tp);
  const pp::ScheduleSpec spec{pp::parse_schedule_kind(schedule.kind),
                              static_cast<int>(schedule.ranks),
                              static_cast<int>(schedule.stages_per_rank),
                              static_cast<int>(schedule.microbatches)};
  enable_memory_tracking();

  // This rank's stages, cut from the whole model built on meta; each is
  // then initialised alone with the whole model's draws (the other stages'
  // made and dropped), so every rank holds the one-process model's values.
  // build_model checks --init-from against the whole model (a file's
  // header, or a directory holding a checkpoint), before any collective.
  torch::manual_seed(options.seed);
  TrainModel whole = build_model(options, corpus.vocab_size, /*meta=*/true);
  const pp::StagePlan plan = pp::plan_stages(whole.layout(), num_stages(spec), options.pp_split);
  // --resume is checked against the whole model, as in the other modes:
  // its checkpoint has the whole model's keys whatever layout saved it.
  const std::optional<ResumePoint> resume_point = find_resume_point(options, whole, root);
  prepare_save_dir(options);
  const nn::InitPlan whole_init = whole.init_plan();
  int64_t parameters = 0;
  std::vector<nn::ParameterShape> shapes;
  for (const auto& item : whole.module().named_parameters(/*recurse=*/true)) {
    parameters += item.value().numel();
    shapes.push_back({item.key(), item.value().sizes().vec()});
  }
  // Stage s is held by pipeline rank stage_rank(s) of every data-parallel
  // rank d (hsdp: d = r * S + s) and tensor-parallel rank t: global rank
  // (d * P + that rank) * T + t, whole (ddp) or a piece each (fsdp, hsdp,
  // tp; the checkpoint gathers it: hp/pp/pipeline_checkpoint.h). A key is
  // written by its lowest holder and read by every holder.
  pp::StageHolders holders{plan, {}};
  for (int s = 0; s < plan.num_stages(); ++s) {
    std::vector<int> ranks;
    for (int64_t r = 0; r < replicas; ++r)
      for (int64_t t = 0; t < tp; ++t)
        ranks.push_back(static_cast<int>((r * schedule.ranks + pp::stage_rank(spec, s)) * tp + t));
    holders.ranks.push_back(std::move(ranks));
  }
  std::vector<pp::StageModule> stages;
  std::vector<nn::InitPlan> inits;
  for (int s : pp::rank_stages(spec, pipeline_rank)) {
    stages.push_back(whole.stage(plan, s));
    inits.push_back(pp::stage_init_plan(whole.module(), whole_init, *stages.back()));
  }
  // The init steps start where the eager model's start: after its
  // constructors' draws (which the meta model made too). Each stage starts
  // from there, as each draws the whole model's sequence. With --init-from
  // the stages stay on meta until they are read from it (collective, below).
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  const at::Tensor init_state = generator.get_state();
  for (size_t i = 0; i < stages.size(); ++i) {
    if (options.init_from.empty()) {
      generator.set_state(init_state);
      init_sharded(*stages[i], inits[i], device.device);
    }
    if (options.activation_checkpointing == "blocks")
      for (const auto& block : stages[i]->blocks()) nn::set_activation_checkpointing(*block);
  }

  std::unique_ptr<StepLog> step_log;
  if (root && !options.log_json.empty()) {
    step_log = std::make_unique<StepLog>(options.log_json, resume_point ? resume_point->step : 0);
  }
  const std::string trace_file =
      options.trace.empty() ? std::string() : trace_path(options.trace, world.rank);
  // As in the other modes: its folder made and the file opened before any
  // collective, so a bad path ends the run now rather than after its steps.
  if (!trace_file.empty()) open_output_file("--trace", trace_file);
  dist::init_process_group();
  dist::GroupPtr group = dist::world_group();
  // As in the other modes: one checkpoint for every rank or none, and
  // --save-dir becomes this job's (checkpoint.h).
  agree_on_resume_point(resume_point);
  if (!options.save_dir.empty()) checkpoint::claim_root(options.save_dir);
  std::string init_line;
  if (!options.init_from.empty()) {
    // Before the pipeline and the optimizer take the stages' parameters:
    // to_empty gives the stages new tensors.
    checkpoint::LoadIntoShardsOptions load_options;
    load_options.device = device.device;
    const checkpoint::LoadResult loaded =
        pp::load_into_stages(stages, holders, shapes, options.init_from, load_options);
    init_line = fmt::format("init: each rank read only its stages from {} ({} read by rank 0)",
                            options.init_from,
                            human_bytes(static_cast<int64_t>(loaded.bytes_read)));
  }
  const bool hsdp = parallelism.mode == plan::ParallelMode::kHSDP;
  // ddp given fully_shard's flags: its units' (replicate, shard) mesh, R x 1.
  const bool ddp_units = parallelism.ddp_stage_units;
  std::vector<int64_t> mesh_shape{replicas};
  std::vector<std::string> dp_dims{"dp"};
  if (hsdp || ddp_units) {
    mesh_shape = {parallelism.replicate_size(), parallelism.shard_size()};
    dp_dims = {"dp_replicate", "dp_shard"};
  }
  std::vector<std::string> mesh_names = dp_dims;
  mesh_shape.insert(mesh_shape.end(), {schedule.ranks, tp});
  mesh_names.insert(mesh_names.end(), {"pp", "tp"});
  const DeviceMeshPtr mesh = init_device_mesh(device.type, mesh_shape, mesh_names);
  dist::GroupPtr pipeline_group = mesh->group_ptr(mesh->dim_index("pp"));
  if (!options.trace.empty()) {
    at::Tensor origin = torch::tensor({trace::unix_now_us()}, torch::kLong);
    dist::broadcast(*group, origin, 0).wait();
    trace::set_origin(origin.item<int64_t>());
    trace::enable(world.rank, fmt::format("rank {}", world.rank));
    if (device.is_cuda()) anchor_cuda_trace(device.device);
  }
  // --mode tp / fsdp_tp: each stage tensor-parallel over the tp dim first,
  // by its share of the whole model's plan (the stage's tensors hold the
  // one-process values, which it splits).
  if (tp > 1) {
    const DeviceMeshPtr tp_mesh = (*mesh)["tp"];
    const ShardingPlan tp_plan = whole.tensor_parallel_plan(*tp_mesh, "tp");
    for (const pp::StageModule& stage : stages)
      shard_module(stage.ptr(), tp_mesh, plan_for_part(tp_plan, *stage));
  }
  whole = TrainModel(nn::GPT(nullptr));  // the meta model's other stages go
  // --mode fsdp / fsdp_tp: each stage sharded over the data-parallel dim,
  // every block a unit and the stage the root (the pipeline keeps it
  // gathered through a step and reduces once: docs/pipeline.md); --mode
  // hsdp: the same over the 2-D (dp_replicate, dp_shard) sub-mesh, as the
  // other modes' hsdp (parallelize.cpp); --mode tp with fully_shard's flags
  // (tp_units): the same over the dp dim of one rank, which only casts (as
  // tp's units in the other modes). --mode ddp: the pipeline averages the
  // replicas' gradients itself; given fully_shard's flags (ddp_units), the
  // stages are units over the replicas and a shard dim of one rank, as
  // ddp's units in the other modes (hsdp over R x 1).
  const bool sharded = parallelism.mode == plan::ParallelMode::kFSDP || hsdp || ddp_units ||
                       parallelism.mode == plan::ParallelMode::kFSDPTP || parallelism.tp_units;
  std::vector<FSDPModule> units;  // every unit of this rank's stages, blocks first
  if (sharded) {
    FullyShardOptions shard;
    shard.mesh = mesh->sub(dp_dims);
    // As the other modes (parallelize.cpp): one gather and one reduction
    // per unit by default, per parameter under --no-comm-fusion.
    shard.comm_fusion = options.comm_fusion;
    // Mixed precision as in the other modes (parallelize.cpp), but for the
    // logits: the loss below casts them to fp32, since the pipeline calls a
    // stage's forward itself (a root's output_dtype would not apply).
    const at::ScalarType param = plan::scalar_type(parallelism.param_dtype);
    if (param != at::kFloat) shard.mp_policy.param_dtype = param;
    if (parallelism.reduce_dtype)
      shard.mp_policy.reduce_dtype = plan::scalar_type(*parallelism.reduce_dtype);
    for (const pp::StageModule& stage : stages) {
      for (const auto& block : stage->blocks()) units.push_back(fully_shard(block, shard));
      units.push_back(fully_shard(stage.ptr(), shard));
    }
  }
  // Stage boundaries carry hidden states in the compute dtype.
  pp::PipelineOptions pipeline_options{spec, options.d,
                                       plan::scalar_type(parallelism.param_dtype), device.device};
  if (replicas > 1 && !sharded) pipeline_options.data_parallel = mesh->group_ptr(0);
  pp::Pipeline pipeline(pipeline_options, stages,
                        std::make_shared<pp::GroupTransport>(pipeline_group),
                        [](const at::Tensor& logits, const at::Tensor& targets) {
                          return nn::cross_entropy(logits.to(at::kFloat), targets);
                        });
  optim::FusedAdamW optimizer(pipeline.parameters(), torch::optim::AdamWOptions(options.lr)
                                                         .betas({0.9, 0.95})
                                                         .eps(1e-8)
                                                         .weight_decay(options.weight_decay));
  // The checkpoints of the other modes (checkpointing.h), of this rank's
  // stages: their tensors under the whole model's keys, the other stages'
  // declared (hp/pp/pipeline_checkpoint.h).
  TrainCheckpoints checkpoints(
      [&](checkpoint::State& state) {
        pp::add_pipeline_model(state, stages, holders, shapes);
        pp::add_pipeline_adamw(state, optimizer, stages, holders, shapes);
      },
      options);

  std::string unit_settings = options.comm_fusion ? "comm fusion on" : "per-parameter collectives";
  if (parallelism.param_dtype != plan::Dtype::kFloat32) {
    unit_settings += fmt::format(", {} compute with {} reduction",
                          plan::dtype_name(parallelism.param_dtype),
                          plan::dtype_name(parallelism.effective_reduce_dtype()));
  }
  std::string mode_line = fmt::format(
      "pipeline over {} ranks{}, {} with {} micro-batches of {} samples, {} stage{} per rank: {}",
      schedule.ranks,
      (replicas <= 1 ? std::string()
       : hsdp        ? fmt::format(" x {} data-parallel ranks (hsdp: {} of each stage, each "
                                   "sharded over {}, gathered once per step, {})",
                                   replicas, plural(parallelism.replicate_size(), "replica"),
                                   plural(parallelism.shard_size(), "rank"), unit_settings)
       : ddp_units   ? fmt::format(" x {} replicas (ddp: each stage fully_shard units "
                                   "replicated over them, a shard of one rank, {})",
                                   replicas, unit_settings)
       : sharded     ? fmt::format(" x {} data-parallel ranks (fsdp: each stage sharded over them, "
                                   "gathered once per step, {})",
                                   replicas, unit_settings)
                     : fmt::format(" x {} replicas (ddp: gradients averaged after each step)",
                                   replicas)) +
          (tp > 1 ? fmt::format(" x {} tensor-parallel ranks per stage", tp) : std::string()) +
          // Units over one data-parallel rank (tp_units, or fsdp, hsdp and
          // fsdp_tp with D = 1) only cast: their settings still show.
          (sharded && replicas <= 1
               ? fmt::format(" (fully_shard units over one data-parallel rank: {})",
                             unit_settings)
               : std::string()),
      schedule.kind, schedule.microbatches, options.batch / replicas / schedule.microbatches,
      schedule.stages_per_rank, schedule.stages_per_rank > 1 ? "s" : "", pp::describe(plan));
  say(root, header_text(options, parallelism, corpus, parameters,
                        device.is_cuda() ? fmt::format("cuda ({})", device.card) : "cpu",
                        mode_line));
  say(root, fmt::format("  bubble: {:.1f}% of each rank's time idle in theory",
                        100 * pp::theoretical_bubble(spec)));
  if (!init_line.empty()) say(root, init_line);

  ProgressMeter meter(options.steps, options.batch * options.seq);
  const TrainCheckpoints::Start beginning = checkpoints.start(resume_point, step_log.get(), meter);
  if (!beginning.line.empty()) say(root, beginning.line);
  const int64_t first_step = beginning.first_step;
  const int last_rank = pp::stage_rank(spec, num_stages(spec) - 1);
  std::vector<int64_t> rank_peaks(world.size, 0);
  double first_loss = 0, last_loss = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t s = first_step; s < options.steps; ++s) {
    trace::Span step_span(fmt::format("step {}", s), "step", "step");
    const auto step_start = std::chrono::steady_clock::now();
    reset_peak_memory();
    for (auto& stage : stages) stage->zero_grad(/*set_to_none=*/true);
    // Every pipeline rank reads the global batch (the first stage its ids,
    // the last its targets, the others its shape).
    Batch batch = batch_for_step(corpus.tokens, s, options.batch, options.seq, replica, replicas);
    if (!device.device.is_cpu()) {
      batch.inputs = batch.inputs.to(device.device);
      batch.targets = batch.targets.to(device.device);
    }
    at::Tensor loss = pipeline.step(batch.inputs, batch.targets);
    // The replicas' gradients are equal after the average: the norm is one
    // replica's, its stages' squared norms summed over its pipeline.
    if (options.grad_clip > 0)
      clip_grad_norm_(pipeline.parameters(), options.grad_clip, 2.0, pipeline_group);
    // --save-async: the last save's copy of the state ends before AdamW
    // changes it.
    checkpoints.wait_for_staging();
    optimizer.step();
    // One gather: the loss (held by the last stage's rank) and every rank's
    // memory peak.
    at::Tensor mine = torch::tensor(
        {loss.defined() ? loss.item<double>() : 0.0, static_cast<double>(memory_stats().peak_bytes)},
        torch::kDouble);
    at::Tensor all = torch::empty({world.size * 2}, torch::kDouble);
    dist::all_gather_into(*group, all, mine).wait();
    all = all.view({-1, 2});
    StepRecord record;
    record.step = s;
    // The replicas' losses (each its last stage's), averaged in replica order.
    for (int64_t r = 0; r < replicas; ++r)
      record.loss += all[(r * schedule.ranks + last_rank) * tp][0].item<double>();
    record.loss /= static_cast<double>(replicas);
    for (int r = 0; r < world.size; ++r) {
      record.rank_peak_bytes.push_back(static_cast<int64_t>(all[r][1].item<double>()));
      rank_peaks[r] = std::max(rank_peaks[r], record.rank_peak_bytes.back());
    }
    record.peak_bytes =
        *std::max_element(record.rank_peak_bytes.begin(), record.rank_peak_bytes.end());
    record.step_time_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    record.tokens_per_s =
        static_cast<double>(options.batch * options.seq) / std::max(record.step_time_s, 1e-9);
    const double step_loss = record.loss;
    if (s == first_step) first_loss = step_loss;
    last_loss = step_loss;
    meter.record(record.step_time_s);
    if (step_log) step_log->write(record);
    if (s == 0 || (s + 1) % options.log_every == 0 || s + 1 == options.steps)
      say(root, meter.line(step_loss));
    if (checkpoints.due(s + 1)) {
      const std::string line = checkpoints.save(s + 1);
      if (!line.empty()) say(root, line);
    }
  }
  if (const std::string line = checkpoints.finish(); !line.empty()) say(root, line);
  // The whole trained model on rank 0, for --export and the sample: its
  // tensors gathered from replica 0's stages (collective over replica 0's
  // pipeline ranks; made once).
  std::optional<TrainModel> gathered;
  bool gathered_once = false;
  auto gather = [&] {
    if (gathered_once) return;
    gathered_once = true;
    // Sharded stages are gathered first (collective over each stage's
    // data-parallel ranks, every replica), then sent whole.
    for (FSDPModule& unit : units) unit.unshard();
    const std::map<std::string, at::Tensor> values = whole_values(stages);
    for (FSDPModule& unit : units) unit.reshard();
    // Replica 0's tp rank 0 ranks: their pipeline group holds rank 0.
    if (replica == 0 && tp_rank == 0)
      gathered = gather_on_rank0(options, corpus.vocab_size, plan, spec, values, *pipeline_group);
  };
  if (!options.export_path.empty()) {
    gather();
    say(root, export_gathered_weights(root ? &*gathered : nullptr, options));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!options.trace.empty()) {
    trace::disable();
    trace::write(trace_file);
    std::cout << fmt::format("trace of rank {} written to {}", world.rank, trace_file) << std::endl;
  }
  if (step_log) say(root, fmt::format("step log written to {}", options.log_json));
  say(root, memory_table(rank_peaks, parameters));

  double sample_seconds = 0;
  if (options.sample_tokens > 0) {
    say(root, fmt::format("sampling {} from the trained model (its stages gathered on rank 0)...",
                          plural(options.sample_tokens, "token")));
    const auto sample_start = std::chrono::steady_clock::now();
    gather();
    if (root) {
      TrainModel& sampler = *gathered;
      sampler.module().eval();
      at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(options.seed);
      at::Tensor prompt = corpus.tokens.narrow(0, 0, 1).view({1, 1});
      at::Tensor sample = sampler.generate(prompt, options.sample_tokens, options.temperature,
                                           options.top_k, generator);
      sample_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - sample_start).count();
      say(root, fmt::format("sample ({} after the corpus's first token, temperature {:g}, top-k "
                            "{}; {:.1f} s):\n{}",
                            plural(options.sample_tokens, "token"), options.temperature,
                            options.top_k, sample_seconds,
                            render_tokens(sample[0], corpus.vocab_size)));
    }
  }
  say(root, final_line(first_loss, last_loss, first_step, options.steps, seconds,
                       options.batch * options.seq, sample_seconds));
  dist::barrier(*group).wait();
  dist::destroy_process_group();
  return 0;
}

}  // namespace hp::train
