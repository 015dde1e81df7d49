// hp-bench (A2): step time, memory and communication of a GPT trained
// with our fully_shard in every mode, side by side with plain libtorch and
// PyTorch's DistributedDataParallel and FSDP2, in one run.
//
//   build/bench/hp-bench --json out/bench.json --png out/bench.png
//
// What each row is (its ranks, how it is launched) is bench/rows.h's table.
//
// The driver (this program without --worker) launches each row as its own
// job, one after another: `hprun -n R hp-bench --worker ROW ...` for our rows,
// `hprun -n R PYTHON bench/torch_ddp_baseline.py ...` (torch_single_baseline.py,
// torch_fsdp2_baseline.py and torch_pipeline_baseline.py beside it) for PyTorch, PYTHON being the build's
// (the project environment's, whose torch is the libtorch built against),
// then `hprun -n 1 hp-bench --worker hook_overhead`. Each prints one result
// line; the driver pools them, prints the table and writes the JSON and the
// plot. A failing row is reported and the others still run; the exit status
// is non-zero when anything failed.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_config.h"
#include "bench/bench_driver.h"
#include "bench/bench_worker.h"
#include "bench/rows.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "hp/util/torch_compat.h"
#include "tools/common/command_line.h"

namespace {

using hp::bench::BenchConfig;
using hp::bench::DriverOptions;

void validate(const DriverOptions& o) {
  const BenchConfig& c = o.config;
  HP_CHECK_ARG(c.vocab >= 2 && c.vocab <= 65536, "--vocab ", c.vocab, " must be in [2, 65536]");
  HP_CHECK_ARG(c.seq >= 1 && c.seq <= c.ctx, "--seq ", c.seq, " must be in [1, --ctx ", c.ctx, "]");
  HP_CHECK_ARG(c.d >= 1 && c.heads >= 1 && c.d % c.heads == 0, "--heads ", c.heads,
               " must divide --d ", c.d);
  HP_CHECK_ARG(c.layers >= 1, "--layers ", c.layers, " must be at least 1");
  HP_CHECK_ARG(c.batch >= 1, "--batch ", c.batch, " must be at least 1");
  HP_CHECK_ARG(o.total_steps >= 1, "--steps ", o.total_steps, " must be at least 1");
  HP_CHECK_ARG(c.warmup >= 0, "--warmup ", c.warmup, " must be at least 0");
  HP_CHECK_ARG(o.rounds >= 1, "--rounds ", o.rounds, " must be at least 1");
  HP_CHECK_ARG(c.ranks >= 1, "--ranks ", c.ranks, " must be at least 1");
  HP_CHECK_ARG(c.hsdp_ranks == 2 || c.hsdp_ranks == 4, "--hsdp-ranks ", c.hsdp_ranks,
               " must be 2 (degenerate [1, 2] mesh) or 4 ([2, 2] mesh)");
  HP_CHECK_ARG(c.hook_units >= 1 && c.hook_width >= 1 && c.hook_batch >= 1 && c.hook_steps >= 1,
               "--hook-units/--hook-width/--hook-batch/--hook-steps must be at least 1");
  HP_CHECK_ARG(c.pp_microbatches >= 1 && c.pp_layers >= 1, "--pp-microbatches ",
               c.pp_microbatches, " and --pp-layers ", c.pp_layers, " must be at least 1");
  for (const auto& r : o.rows) {
    const hp::bench::Row& row = hp::bench::find_row_spec(r);  // throws for an unknown row
    if (const hp::bench::PipelineRow* pp = hp::bench::pipeline_row(row)) {
      HP_CHECK_ARG(c.device == "cpu", "--rows ", r, " runs on the CPU only (Gloo)");
      HP_CHECK_ARG(c.batch % c.pp_microbatches == 0, "--rows ", r, ": --batch ", c.batch,
                   " (the pipeline's shared batch) must be a multiple of --pp-microbatches ",
                   c.pp_microbatches);
      HP_CHECK_ARG(c.pp_microbatches % pp->data_parallel == 0, "--rows ", r, ": --pp-microbatches ",
                   c.pp_microbatches, " must be a multiple of its ", pp->data_parallel,
                   " data-parallel ranks (each replica runs its share of the micro-batches)");
      const int64_t stages = pp->pipeline_ranks(row.ranks(c)) * pp->stages_per_rank;
      HP_CHECK_ARG(c.pp_layers >= stages, "--rows ", r, " cuts the GPT into ", stages,
                   " stages of at least one block each: --pp-layers ", c.pp_layers,
                   " must be at least ", stages);
    }
    HP_CHECK_ARG(c.device == "cpu" || row.launcher != hp::bench::RowLauncher::kCheckpoint,
                 "--rows ", r, " measures saving from host memory; it does not run with --device ",
                 c.device);
  }
  // Launched with execve, which searches no PATH: "python3" alone would
  // fail at the plot, after every row ran.
  HP_CHECK_ARG(o.python.find('/') != std::string::npos, "--python '", o.python,
               "' must be a path to the interpreter, e.g. $(command -v ", o.python, ")");
  if (c.device == "cuda") hp::compat::require_cuda("--device cuda");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hp-bench: our fully_shard modes vs plain libtorch and PyTorch DDP, one run"};
  DriverOptions o;
  BenchConfig& c = o.config;
  std::string worker, rows;
  bool no_hook = false;
  app.add_option("--json", o.json_path, "where to write the results (out/bench.json)");
  app.add_option("--png", o.png_path, "where to write the plot (none by default)");
  app.add_option("--steps", o.total_steps, "timed steps per row, over all rounds (20)");
  app.add_option("--warmup", c.warmup, "untimed steps per row and round (3)");
  app.add_option("--rounds", o.rounds, "each row runs once per round, rows interleaved (2)");
  app.add_option("--ranks", c.ranks, "ranks of the data-parallel and tensor-parallel rows (2)");
  app.add_option("--hsdp-ranks", c.hsdp_ranks,
                 "ranks of hsdp_fused_prefetch: 2 = degenerate [1,2] mesh, 4 = [2,2] (2)");
  const std::string rows_help = "comma-separated rows to run (default: " +
                                hp::to_string(hp::bench::row_names()) + "; extras: " +
                                hp::to_string(hp::bench::extra_row_names()) + ")";
  app.add_option("--rows", rows, rows_help);
  app.add_option("--device", c.device,
                 "cpu (Gloo), or cuda: one GPU per local rank (NCCL; HP_SHARE_GPUS=1 lets ranks "
                 "share one, for correctness only), timed with CUDA events; cuda's defaults are "
                 "the GPU configuration (d 1024, 12 layers, 16 heads, ctx and seq 1024, bf16 "
                 "parameters, fp32 reduction; rows " +
                     hp::to_string(hp::bench::gpu_row_names()) +
                     "; no hook, dispatch or checkpoint rows) where not given (cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--param-dtype", c.param_dtype,
                 "compute and all-gather dtype of the fully_shard rows (not ddp) and torch_fsdp2 "
                 "(fp32; bf16 with --device cuda)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--reduce-dtype", c.reduce_dtype,
                 "their gradient reduction dtype (default: --param-dtype; fp32 with --device cuda)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--vocab", c.vocab, "vocabulary (512)");
  app.add_option("--seq", c.seq, "tokens per sample (128)");
  app.add_option("--d", c.d, "model width (256)");
  app.add_option("--heads", c.heads, "attention heads (4)");
  app.add_option("--layers", c.layers, "transformer blocks (4)");
  app.add_option("--ctx", c.ctx, "context (128)");
  app.add_option("--batch", c.batch,
                 "samples per rank and step (8); the tensor- and pipeline-parallel rows' ranks "
                 "share one such batch");
  app.add_option("--pp-layers", c.pp_layers,
                 "transformer blocks of the pipeline rows' GPT (8: 8 stages for the interleaved "
                 "schedules over 4 ranks)");
  app.add_option("--pp-microbatches", c.pp_microbatches,
                 "micro-batches per step of the pipeline rows; --batch must be a multiple (8); "
                 "dp2_pp2's replicas take half each");
  app.add_option("--pp-split", c.pp_split,
                 "how the pipeline rows cut the GPT into stages, ours and PyTorch's alike: even "
                 "(the same number of blocks per stage, so the stages cost about the same, as "
                 "the bubble formulas assume) or balanced (hp::pp::plan_stages's default: the "
                 "embeddings and the head count as a block each) (even)")
      ->check(CLI::IsMember({"even", "balanced"}));
  app.add_option("--lr", c.lr, "AdamW learning rate (1e-3)");
  app.add_option("--beta1", c.beta1, "AdamW beta1 (0.9)");
  app.add_option("--beta2", c.beta2, "AdamW beta2 (0.95)");
  app.add_option("--eps", c.eps, "AdamW eps (1e-8)");
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay (0.1)");
  app.add_option("--seed", c.seed, "weights and data (1337)");
  app.add_flag("--no-hook-overhead", no_hook, "skip the hook overhead measurement");
  bool no_dispatch = false;
  app.add_flag("--no-dispatch-overhead", no_dispatch,
               "skip the DTensor op dispatch measurement");
  app.add_option("--hook-units", c.hook_units, "tiny blocks in the hook-overhead model (64)");
  app.add_option("--hook-width", c.hook_width, "their Linear width (16)");
  app.add_option("--hook-batch", c.hook_batch, "their batch (8)");
  app.add_option("--hook-steps", c.hook_steps, "timed forward+backward steps per variant (400)");
  app.add_option("--ckpt-layers", c.ckpt_layers, "checkpoint row: GPT blocks (14)")
      ->check(CLI::PositiveNumber);
  app.add_option("--ckpt-d", c.ckpt_d, "checkpoint row: GPT width (768; with 14 blocks ~100M parameters)")
      ->check(CLI::PositiveNumber);
  app.add_option("--ckpt-dir", c.ckpt_dir, "checkpoint row: where to write (/tmp)")
      ->check(CLI::ExistingDirectory);
  app.add_option("--ckpt-repeats", c.ckpt_repeats, "checkpoint row: save/load repeats (2)")
      ->check(CLI::PositiveNumber);
  app.add_option("--profile-ops", c.profile_ops_dir,
                 "write each GPT row's per-op CPU profile of its timed steps (all rounds) to "
                 "DIR/<row>.rank<r>.ops.json (earlier ones there are removed) and our rows "
                 "against PyTorch's to DIR/compare.txt; profiled step times are not the "
                 "benchmark's");
  app.add_option("--hprun", o.hprun, "the launcher (default: tools/hprun/hprun of this build)");
  app.add_option("--python", o.python,
                 "the path of a Python with PyTorch, for the torch_ rows and the plot (default: "
                 HP_PYTHON ")");
  app.add_option("--torch-script", o.torch_script,
                 "a torch_ddp_baseline.py: every PyTorch row's script (torch_single_, "
                 "torch_ddp_, torch_fsdp2_, torch_pipeline_baseline.py, "
                 "torch_baseline_common.py) is taken from its directory");
  app.add_option("--plot-script", o.plot_script, "the plotting script");
  app.add_option("--row-timeout", o.row_timeout_s, "seconds one row's job may take (180)");
  app.add_flag("--verbose", o.verbose, "echo the rows' output");
  // Internal: what the driver passes to the processes it launches.
  app.add_option("--worker", worker, "(internal) run one row's worker")->group("");
  app.add_option("--tokens", c.tokens_path, "(internal) token file")->group("");
  app.add_option("--worker-steps", c.steps, "(internal) timed steps of this worker")->group("");
  try {
    const hp::tools::ParsedCommandLine parsed = hp::tools::parse_command_line(
        app, std::vector<std::string>(argv + 1, argv + argc), "see hp-bench --help");
    if (parsed.help_requested) {
      std::cout << parsed.help_text;
      return 0;
    }
  } catch (const hp::tools::CommandLineError& e) {
    std::fprintf(stderr, "hp-bench: error: %s\n", e.what());
    return 2;
  }

  try {
    o.hook_overhead = !no_hook;
    o.dispatch_overhead = !no_dispatch;
    if (c.device == "cuda") {
      // The GPU configuration, for what the command line leaves out: a GPT
      // that keeps a GPU busy, in the GPU recipe's precision.
      auto unless_given = [&](const char* flag, auto& field, auto value) {
        if (app.count(flag) == 0) field = value;
      };
      unless_given("--d", c.d, int64_t{1024});
      unless_given("--layers", c.layers, int64_t{12});
      unless_given("--heads", c.heads, int64_t{16});
      unless_given("--ctx", c.ctx, int64_t{1024});
      unless_given("--seq", c.seq, int64_t{1024});
      unless_given("--param-dtype", c.param_dtype, std::string("bf16"));
      unless_given("--reduce-dtype", c.reduce_dtype, std::string("fp32"));
      // The hook and dispatch measurements time the host alone.
      o.hook_overhead = false;
      o.dispatch_overhead = false;
      if (rows.empty() && worker.empty()) o.rows = hp::bench::gpu_row_names();
    }
    std::stringstream list(rows);
    for (std::string r; std::getline(list, r, ',');) {
      if (!r.empty()) o.rows.push_back(r);
    }
    validate(o);
    if (worker == "hook_overhead") return hp::bench::run_hook_worker(c);
    if (worker == "dispatch_overhead") return hp::bench::run_dispatch_worker(c);
    if (worker == "checkpoint") return hp::bench::run_checkpoint_worker(c);
    if (!worker.empty()) {
      HP_CHECK_ARG(!c.tokens_path.empty(), "--worker needs --tokens FILE");
      HP_CHECK_ARG(c.steps >= 1, "--worker-steps ", c.steps, " must be at least 1");
      if (hp::bench::pipeline_row(hp::bench::find_row_spec(worker)))
        return hp::bench::run_pipeline_worker(worker, c);
      return hp::bench::run_gpt_worker(worker, c);
    }
    return hp::bench::run_driver(o);
  } catch (const hp::ArgumentError& e) {
    std::fprintf(stderr, "hp-bench: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hp-bench: %s\n", e.what());
    return 1;
  }
}
