#include "tools/hp_train/train_options.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <variant>

#include "hp/pp/schedule.h"
#include "hp/util/error.h"
#include "hp/util/format.h"
#include "hp/util/torch_compat.h"
#include "tools/common/command_line.h"
#include "tools/hp_train/progress.h"

namespace hp::train {
namespace {

// Every value is checked by a CLI11 validator before CLI11 converts it into
// its typed field, so each message has one shape: flag, value, expectation
// ("--batch must be a positive integer, got '0'"). The validators accept
// plain decimal numbers only: CLI11's own conversion would also take "0x10"
// or " 7".

bool is_decimal(const std::string& value, bool allow_minus) {
  const size_t digits = allow_minus && !value.empty() && value[0] == '-' ? 1 : 0;
  return value.size() > digits &&
         std::all_of(value.begin() + static_cast<std::ptrdiff_t>(digits), value.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// The text of a decimal integer once parsed: false when it does not fit T
// (strtoll saturates silently, so the value must print back as written).
template <typename T>
bool fits(const std::string& value, T parsed) {
  std::string digits = value[0] == '-' ? value.substr(1) : value;
  digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size() - 1));
  return fmt::format("{}{}", value[0] == '-' ? "-" : "", digits) == fmt::format("{}", parsed);
}

CLI::Validator integer_in(int64_t min, int64_t max, std::string expected) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        int64_t parsed = 0;
        const bool ok = is_decimal(value, /*allow_minus=*/true) &&
                        CLI::detail::lexical_cast(value, parsed) && fits(value, parsed) &&
                        parsed >= min && parsed <= max;
        return ok ? std::string() : fmt::format("must be {}, got '{}'", expected, value);
      },
      "", "integer_in");
}

CLI::Validator positive_integer() {
  return integer_in(1, std::numeric_limits<int64_t>::max(), "a positive integer");
}

CLI::Validator non_negative_integer() {
  return integer_in(0, std::numeric_limits<int64_t>::max(), "a non-negative integer");
}

// Finite numbers above zero, or from zero with allow_zero.
CLI::Validator number(bool allow_zero, std::string expected) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        double parsed = 0;
        const bool ok = !value.empty() && CLI::detail::lexical_cast(value, parsed) &&
                        std::isfinite(parsed) && (parsed > 0 || (allow_zero && parsed == 0));
        return ok ? std::string() : fmt::format("must be {}, got '{}'", expected, value);
      },
      "", "number");
}

CLI::Validator one_of(std::vector<std::string> choices) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        if (std::find(choices.begin(), choices.end(), value) != choices.end()) return "";
        return fmt::format("must be one of {}, got '{}'", fmt::join(choices, ", "), value);
      },
      "", "one_of");
}

const CLI::Validator kFileName(
    [](std::string& value) -> std::string {
      return value.empty() ? "must name a file, got ''" : "";
    },
    "", "file_name");

// The largest mesh dim: far beyond any job, and small enough that the
// product of three dims, compared with the world size, cannot overflow.
constexpr int64_t kMaxMeshDim = 1 << 20;

// "4" -> {4}, "2x2" -> {2, 2}; empty when `value` is not of that form (at
// most 3 dims, each in [1, kMaxMeshDim]).
std::vector<int64_t> mesh_shape_of(const std::string& value) {
  std::vector<int64_t> shape;
  size_t begin = 0;
  while (shape.size() <= 3) {
    const size_t x = value.find('x', begin);
    const std::string part = value.substr(begin, x == std::string::npos ? x : x - begin);
    int64_t n = 0;
    if (!is_decimal(part, false) || !CLI::detail::lexical_cast(part, n) || !fits(part, n) ||
        n < 1 || n > kMaxMeshDim) {
      return {};
    }
    shape.push_back(n);
    if (x == std::string::npos) return shape.size() <= 3 ? shape : std::vector<int64_t>{};
    begin = x + 1;
  }
  return {};
}

const CLI::Validator kMesh(
    [](std::string& value) -> std::string {
      if (!mesh_shape_of(value).empty()) return "";
      return fmt::format("must be N, RxS (R replicas x S shards) or, under --pp, DxPxT or RxSxP "
                         "with positive integers (each at most {}), e.g. 4, 2x2 or 2x2x2, got "
                         "'{}'",
                         kMaxMeshDim, value);
    },
    "", "mesh");

const CLI::Validator kReshardAfterForward(
    [](std::string& value) -> std::string {
      if (value == "true" || value == "false") return "";
      return integer_in(1, std::numeric_limits<int64_t>::max(), "")(value).empty()
                 ? ""
                 : fmt::format("must be true, false or a positive number of ranks, got '{}'",
                               value);
    },
    "", "reshard_after_forward");

// libtorch 1.13's CPU kernels (this build's only device) have no fp16
// matmul, LayerNorm, softmax or GELU: a run would start and then fail in the
// first forward on every rank. bf16 has the same 16-bit traffic and fp32's
// exponent range. (fp16 gradient reduction is only a sum, and works.)
const CLI::Validator kComputeDtype(
    [](std::string& value) -> std::string {
      if (value == "bf16" || value == "fp32") return "";
      if (value == "fp16") {
        return "fp16 is not supported: libtorch's CPU kernels have no fp16 matmul, LayerNorm, "
               "softmax or GELU, so every rank would fail in its first forward; use bf16 (the "
               "same 16-bit all-gathers, fp32's exponent range) or fp32";
      }
      return fmt::format("must be one of bf16, fp32, got '{}'", value);
    },
    "", "compute_dtype");

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CLI::App app{"Trains a GPT or a Llama with AdamW on a real corpus (Debian's fortunes by "
               "default), on one process or on the ranks of hprun with FSDP, HSDP or DDP.",
               "hp-train"};
  app.footer(
      "Examples:\n"
      "  hprun -n 2 hp-train                      FSDP on 2 ranks, the default config\n"
      "  hprun -n 4 hp-train --mode hsdp --mesh 2x2\n"
      "  hp-train --mode none --steps 50          one process\n"
      "Every flag is validated before any communication; errors name the flag.\n");

  CommandLine result;
  TrainOptions& o = result.options;
  const TrainOptions defaults;
  std::string mode, reshard_after_forward, param_dtype = "fp32", reduce_dtype;

  // A repeated flag takes its last value, so a script can append overrides.
  auto option = [&](const std::string& name, auto& field, const std::string& help,
                    const std::string& value_name, const CLI::Validator& validator) {
    return app.add_option(name, field, help)
        ->type_name(value_name)
        ->check(validator)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  };
  option("--model", o.model, "gpt (GPT-2) | llama (Llama: RMSNorm, rotary positions, SwiGLU, "
         "grouped-query attention; default gpt)", "M", one_of({"gpt", "llama"}));
  option("--kv-heads", o.kv_heads,
         "--model llama: key/value heads, dividing --heads (default: --heads)", "K",
         positive_integer());
  option("--layers", o.layers, fmt::format("transformer blocks (default {})", defaults.layers),
         "L", positive_integer());
  option("--d", o.d, fmt::format("model width (default {})", defaults.d), "D",
         positive_integer());
  option("--heads", o.heads,
         fmt::format("attention heads, dividing --d (default {})", defaults.heads), "H",
         positive_integer());
  option("--ctx", o.ctx, fmt::format("context length of the model (default {})", defaults.ctx),
         "C", positive_integer());
  option("--data-file", o.data_file,
         "raw little-endian uint16 tokens (default: fortunes as bytes)", "FILE", kFileName);
  option("--vocab", o.vocab, "vocabulary size; required with --data-file (bytes: 256)", "V",
         integer_in(1, 65536, "a positive integer at most 65536 (uint16 tokens)"));
  option("--batch", o.batch,
         fmt::format("GLOBAL batch, split over data-parallel ranks (default {})", defaults.batch),
         "B", positive_integer());
  option("--seq", o.seq,
         fmt::format("tokens per sample, at most --ctx (default {})", defaults.seq), "T",
         positive_integer());
  option("--steps", o.steps, fmt::format("optimizer steps (default {})", defaults.steps), "S",
         positive_integer());
  option("--lr", o.lr, fmt::format("constant AdamW learning rate (default {})", defaults.lr),
         "X", number(false, "a positive number"));
  option("--weight-decay", o.weight_decay,
         fmt::format("AdamW weight decay, all parameters (default {})", defaults.weight_decay),
         "W", number(true, "a non-negative number"));
  option("--grad-clip", o.grad_clip,
         fmt::format("clip the global gradient norm; 0 disables (default {})", defaults.grad_clip),
         "C", number(true, "a non-negative number (0 disables clipping)"));
  option("--seed", o.seed,
         fmt::format("seeds the weights and the sample (default {})", defaults.seed), "S",
         CLI::Validator(
             [](std::string& value) -> std::string {
               uint64_t parsed = 0;
               const bool ok = is_decimal(value, false) &&
                               CLI::detail::lexical_cast(value, parsed) && fits(value, parsed);
               return ok ? "" : fmt::format("must be a non-negative integer below 2^64, got '{}'",
                                            value);
             },
             "", "seed"));
  option("--mode", mode,
         "fsdp | hsdp | ddp | tp | fsdp_tp | none (default: fsdp under a launcher, else none); "
         "tp is tensor parallelism over --mesh T ranks, fsdp_tp FSDP over D data-parallel "
         "ranks of tensor-parallel groups of T (--mesh DxT)",
         "M", one_of(plan::mode_names()));
  option("--mesh", o.mesh,
         "mesh shape: N ranks, or RxS = R replicas (data-parallel copies) x S shards each, for "
         "--mode hsdp, or DxT for --mode fsdp_tp; under --pp P: DxP (fsdp, ddp), RxSxP (hsdp), "
         "PxT (tp), DxPxT (fsdp_tp); its product is the world size (default: the world size)",
         "N|RxS|DxT|RxSxP|DxPxT", kMesh);
  option("--init", o.init,
         "meta: build the model on the meta device and give each rank only its shards, "
         "initialised as the eager model would be (or read from --init-from); eager: every "
         "rank builds the whole model first (default: meta in the sharded modes fsdp, hsdp, "
         "tp, fsdp_tp; eager for none and ddp)",
         "eager|meta", one_of({"eager", "meta"}));
  option("--init-from", o.init_from,
         "initial weights (.safetensors) by parameter name; under --init meta and under --pp "
         "(each rank reads its stages) also a checkpoint directory (--save-dir's)",
         "FILE|DIR", kFileName);
  option("--log-json", o.log_json,
         "rank 0 writes one JSON object per step, one per line: step (0-based), loss, "
         "step_time_s, tokens_per_s, peak_bytes; FILE's folder is created if missing",
         "FILE", kFileName);
  option("--save-dir", o.save_dir,
         "save a sharded checkpoint (DIR/step-N) every --save-every steps and at the end; "
         "under --pp each rank writes its stages, under the whole model's keys",
         "DIR", kFileName);
  option("--save-every", o.save_every,
         "steps between checkpoints, with --save-dir (default: only at the end)", "N",
         positive_integer());
  app.add_flag("--save-async", o.save_async,
               "with --save-dir: write each checkpoint on a background thread; training stalls "
               "only to copy the state into host memory");
  option("--resume", o.resume,
         "continue from the newest complete checkpoint in DIR (any mode, mesh or --pp saved "
         "it); --steps stays the total; 'auto': from the newest one in --save-dir when there is "
         "one, else from scratch (for jobs that hprun --max-restarts restarts; not the "
         "default); a folder named auto is ./auto",
         "DIR|auto", kFileName);
  option("--export", o.export_path,
         "write the trained weights, whole, by parameter name, to FILE.safetensors at the end "
         "(under --pp the stages are gathered on rank 0, which writes them)",
         "FILE", kFileName);
  option("--device", o.device,
         "cuda: each local rank trains on its own GPU (GPU LOCAL_RANK; more local ranks than "
         "GPUs are refused unless HP_SHARE_GPUS=1); cpu: on the host (default: cuda when a GPU "
         "is visible, else cpu)",
         "cuda|cpu", one_of({"cuda", "cpu"}));
  option("--peak-tflops", o.peak_tflops,
         "the GPU's dense bf16 peak in TFLOP/s, for the MFU of the progress line (default: "
         "known from the card's name for H100, H200, A100, B200 and a few others)",
         "X", number(false, "a positive number"));
  option("--threads", o.threads,
         fmt::format("torch intra-op threads per rank (default {})", defaults.threads), "N",
         integer_in(1, 1024, "a positive integer at most 1024"));
  option("--log-every", o.log_every,
         fmt::format("progress line every N steps (default {})", defaults.log_every), "N",
         positive_integer());
  option("--sample-tokens", o.sample_tokens,
         fmt::format("tokens to sample at the end; 0 disables (default {})",
                     defaults.sample_tokens),
         "N", non_negative_integer());
  option("--temperature", o.temperature,
         fmt::format("sampling temperature (default {})", defaults.temperature), "X",
         number(false, "a positive number"));
  option("--top-k", o.top_k,
         fmt::format("sample among the K likeliest tokens; 0 = all (default {})", defaults.top_k),
         "K", non_negative_integer());
  app.add_flag("--dry-run", o.dry_run,
               "print each rank's memory plan (the predicted peak of a training step, by term) "
               "and exit: no step, no collective; with --log-json, rank 0 writes one JSON object "
               "per rank; under --pp, each pipeline rank's plan covers its stages and the "
               "micro-batches its schedule keeps in flight");
  // fully_shard's flags.
  auto* comm_fusion = app.add_flag(
      "--comm-fusion,!--no-comm-fusion", o.comm_fusion,
      "one all-gather and one reduce-scatter per unit over flat buffers (default: on). "
      "--no-comm-fusion takes the per-parameter path (FSDP2's default): one all-gather and one "
      "reduce-scatter per parameter, slower; for comparing against that path or seeing each "
      "parameter's collectives in a --trace");
  // The description as a const std::string: under C++20 (libtorch 2.x)
  // arrays are constructible from integers, and CLI11 2.1 then takes a
  // literal description for a counter as well.
  const std::string no_prefetch_help =
      "do not gather the next unit while this one computes (prefetch is on by default)";
  auto* no_prefetch = app.add_flag("--no-prefetch", no_prefetch_help);
  option("--reshard-after-forward", reshard_after_forward,
         "after forward, the blocks free their gathered parameters (true, default), keep them "
         "(false), or keep them gathered within groups of N ranks; the root and the last block "
         "keep theirs, their backward following at once",
         "true|false|N", kReshardAfterForward);
  option("--param-dtype", param_dtype, "compute and all-gather dtype (default fp32)",
         "bf16|fp32", kComputeDtype);
  option("--reduce-dtype", reduce_dtype, "gradient reduction dtype (default: --param-dtype)",
         "bf16|fp16|fp32", one_of({"bf16", "fp16", "fp32"}));
  option("--activation-checkpointing", o.activation_checkpointing,
         "blocks: keep only each block's input from forward and recompute the block in "
         "backward (less memory, about one more forward of compute); any --mode "
         "(default none)",
         "none|blocks", one_of({"none", "blocks"}));
  option("--pp", o.pp,
         "pipeline parallelism over P ranks: each runs its stages of the model, activations "
         "and their gradients travel between neighbours (default 1: none); the world is the P "
         "pipeline ranks, or D x P with --mode ddp (D replicas of the pipeline) or fsdp (each "
         "stage sharded over D ranks), R x S x P with --mode hsdp --mesh RxSxP (each stage "
         "sharded over S ranks, R replicas), P x T with --mode tp, D x P x T with --mode "
         "fsdp_tp",
         "P", integer_in(1, 4096, "an integer in [1, 4096]"));
  option("--pp-schedule", o.pp_schedule,
         "the pipeline schedule (default 1f1b): gpipe (all forwards, then all backwards), 1f1b "
         "(one forward, one backward: fewer micro-batches' activations live), interleaved "
         "(1f1b over several stages per rank: a smaller bubble), zero-bubble (interleaved, each "
         "backward split into its input and weight halves)",
         "gpipe|1f1b|interleaved|zero-bubble", one_of({"gpipe", "1f1b", "interleaved", "zero-bubble"}));
  option("--microbatches", o.microbatches,
         "micro-batches per step under --pp (default: twice the number of stages); --batch must "
         "be a multiple",
         "M", integer_in(1, 1 << 20, "an integer in [1, 1048576]"));
  option("--pp-stages-per-rank", o.pp_stages_per_rank,
         "stages per pipeline rank (default 1 for gpipe and 1f1b, 2 for interleaved and "
         "zero-bubble)",
         "V", integer_in(1, 64, "an integer in [1, 64]"));
  app.add_option("--pp-split", o.pp_split,
                 "the blocks that begin stages 1, 2, ... (e.g. h.3,h.5; default: balanced, the "
                 "embeddings and the head counted as one block each)")
      ->type_name("BLOCK,...")
      ->delimiter(',')
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  option("--trace", o.trace,
         "Chrome trace JSON per rank: FILE with .rank<r> before the extension; every rank's "
         "timestamps count from the same instant",
         "FILE", kFileName);

  try {
    const tools::ParsedCommandLine parsed =
        tools::parse_command_line(app, args, "see hp-train --help");
    if (parsed.help_requested) {
      result.help_requested = true;
      result.help_text = parsed.help_text;
      return result;
    }
  } catch (const tools::CommandLineError& e) {
    throw_argument_error(e.what());
  }

  if (!mode.empty()) {
    o.mode = plan::parse_mode(mode, "--mode");
    o.mode_given = true;
  }
  o.prefetch = no_prefetch->count() == 0;
  if (!reshard_after_forward.empty()) {
    o.reshard_after_forward =
        plan::parse_reshard_after_forward(reshard_after_forward, "--reshard-after-forward");
  }
  o.param_dtype = plan::parse_dtype(param_dtype, "--param-dtype");
  if (!reduce_dtype.empty()) o.reduce_dtype = plan::parse_dtype(reduce_dtype, "--reduce-dtype");
  if (comm_fusion->count() > 0) {
    o.fully_shard_flags.push_back(o.comm_fusion ? "--comm-fusion" : "--no-comm-fusion");
  }
  for (const char* name : {"--no-prefetch", "--reshard-after-forward", "--reduce-dtype"}) {
    if (app.count(name) > 0) o.fully_shard_flags.push_back(name);
  }
  // fp32 is what one process computes in anyway.
  if (o.param_dtype != plan::Dtype::kFloat32) o.fully_shard_flags.push_back("--param-dtype");
  return result;
}

namespace {

// The mesh init_device_mesh builds for `mode` from --mesh (or the world),
// checked against the world; empty for --mode none.
std::vector<int64_t> resolve_mesh(plan::ParallelMode mode, const TrainOptions& options,
                                  const World& world) {
  using plan::ParallelMode;
  const std::string name = plan::mode_name(mode);
  const std::vector<int64_t> shape = options.mesh.empty()
                                         ? std::vector<int64_t>{world.size}
                                         : mesh_shape_of(options.mesh);
  HP_CHECK_ARG(shape.size() <= 2, "--mesh ", options.mesh, " has three dims: a D x P x T mesh is "
               "for --pp P --mode fsdp_tp; --mode ", name, " takes N or RxS");
  if (mode == ParallelMode::kNone) {
    HP_CHECK_ARG(world.size == 1, "--mode none trains in one process, but WORLD_SIZE is ",
                 world.size, "; use --mode fsdp, hsdp or ddp with several ranks, or start one "
                 "process");
    HP_CHECK_ARG(shape == std::vector<int64_t>{1}, "--mesh ", options.mesh,
                 " does not apply to --mode none, which runs one process; leave --mesh out");
    return {};
  }
  HP_CHECK_ARG(world.launched, "--mode ", name,
               " needs one process per rank started by a launcher (hprun -n N hp-train ...: "
               "RANK and WORLD_SIZE are not set); use --mode none for a single process");
  if (mode == ParallelMode::kHSDP) {
    HP_CHECK_ARG(!options.mesh.empty(), "--mode hsdp needs --mesh RxS (replicas x shards, "
                 "R*S = the world size ", world.size, ")");
    HP_CHECK_ARG(shape.size() == 2, "--mode hsdp needs a 2-D mesh RxS (replicas x shards), got "
                 "--mesh ", options.mesh);
  } else if (mode == ParallelMode::kFSDPTP) {
    HP_CHECK_ARG(!options.mesh.empty(), "--mode fsdp_tp needs --mesh DxT (data-parallel x "
                 "tensor-parallel ranks, D*T = the world size ", world.size, ")");
    HP_CHECK_ARG(shape.size() == 2, "--mode fsdp_tp needs a 2-D mesh DxT (data-parallel x "
                 "tensor-parallel ranks), got --mesh ", options.mesh);
  } else {
    HP_CHECK_ARG(shape.size() == 1, "--mode ", name, " needs a 1-D mesh N, got --mesh ",
                 options.mesh, " (a 2-D mesh RxS is --mode hsdp)");
  }
  const int64_t product = std::accumulate(shape.begin(), shape.end(), int64_t{1},
                                          std::multiplies<int64_t>());
  HP_CHECK_ARG(product == world.size, "--mesh ", fmt::format("{}", fmt::join(shape, "x")),
               " holds ", plural(product, "rank"), ", but the world has ", world.size,
               " (WORLD_SIZE); the mesh's product must equal the world size");
  // fully_shard's DDP: a replicate dim over every rank, a shard dim of one.
  if (mode == ParallelMode::kDDP) return {shape[0], 1};
  return shape;
}

// The fully_shard flags a pipeline does not take. Its stages are gathered
// once per step and reduced once (docs/pipeline.md), so there is no
// prefetch or reshard after forward to choose. --comm-fusion and
// --no-comm-fusion choose how a stage's gathers and reductions travel, and
// apply where fully_shard makes units of the stages (fsdp, hsdp, fsdp_tp;
// tp and ddp given one of these flags, whose stages then become units over
// a data-parallel dim of one rank (tp) or a shard dim of one rank (ddp), as
// these modes' units outside a pipeline); mixed precision (--param-dtype,
// --reduce-dtype) to the same stages. Without --mode there are no units.
std::vector<std::string> flags_refused_under_pp(const TrainOptions& options,
                                                plan::ParallelMode mode) {
  const bool units = mode != plan::ParallelMode::kNone;
  std::vector<std::string> refused;
  for (const std::string& flag : options.fully_shard_flags) {
    const bool fusion = flag == "--comm-fusion" || flag == "--no-comm-fusion";
    const bool precision = flag == "--param-dtype" || flag == "--reduce-dtype";
    if (!((fusion || precision) && units)) refused.push_back(flag);
  }
  return refused;
}

}  // namespace

Parallelism resolve_parallelism(const TrainOptions& options, const World& world) {
  using plan::ParallelMode;
  if (options.pp > 1) {
    // The pipeline's ranks are the world, or D x P x T of it: D replicas of
    // the pipeline (--mode ddp, each stage whole) or D ranks sharding each
    // stage (--mode fsdp; --mode hsdp: D = R x S, each stage sharded over S
    // ranks and replicated R times), T ranks splitting each stage's layers
    // (--mode tp), or both (--mode fsdp_tp).
    HP_CHECK_ARG(world.launched, "--pp ", options.pp,
                 " needs one process per pipeline rank started by a launcher (hprun -n ",
                 options.pp, " hp-train --pp ", options.pp, " ...)");
    const ParallelMode mode = options.mode_given ? options.mode : ParallelMode::kNone;
    const bool replicas = mode == ParallelMode::kDDP;
    const bool hsdp = mode == ParallelMode::kHSDP;
    const bool sharded =
        mode == ParallelMode::kFSDP || hsdp || mode == ParallelMode::kFSDPTP;
    const bool tensor_parallel = mode == ParallelMode::kTP || mode == ParallelMode::kFSDPTP;
    HP_CHECK_ARG(world.size % options.pp == 0 && (mode != ParallelMode::kNone || world.size == options.pp),
                 "--pp ", options.pp,
                 mode != ParallelMode::kNone
                     ? hp::cat(" --mode ", plan::mode_name(mode), " runs on a multiple of ")
                     : std::string(" runs on exactly "),
                 options.pp, " ranks (", mode != ParallelMode::kNone ? "a multiple of " : "one per ",
                 "pipeline rank), but WORLD_SIZE is ", world.size);
    const std::vector<std::string> refused = flags_refused_under_pp(options, mode);
    const char* it_or_them = refused.size() == 1 ? "it" : "them";
    HP_CHECK_ARG(refused.empty(), fmt::format("{}", fmt::join(refused, " ")), " with --pp ",
                 options.pp, " --mode ", plan::mode_name(mode),
                 mode != ParallelMode::kNone
                     ? hp::cat(": the pipeline gathers each stage once per step (--comm-fusion, "
                               "--no-comm-fusion, --param-dtype and --reduce-dtype are the "
                               "fully_shard flags it takes); leave ", it_or_them, " out")
                     : hp::cat(": the stages are not fully_shard units; leave ", it_or_them,
                               " out, or add --mode fsdp (on ", options.pp,
                               " ranks each stage's units are over one data-parallel rank, "
                               "which only cast)"));
    // The mesh is D x P x T (dp, pp, tp); --mesh names the dims the mode has.
    int64_t dp_size = tensor_parallel ? 1 : world.size / options.pp;
    int64_t tp_size = tensor_parallel ? world.size / options.pp : 1;
    const char* dims = mode == ParallelMode::kFSDPTP ? "D x P x T"
                       : tensor_parallel            ? "P x T"
                                                    : "D x P";
    // hsdp's R x S data-parallel ranks of D x P: --mesh RxSxP, the
    // pipeline dim last as in D x P, so a rank's data-parallel index (r * S
    // + s: its slice of the batch) and pipeline rank are fsdp's.
    int64_t hsdp_replicas = 1;
    if (hsdp) {
      HP_CHECK_ARG(!options.mesh.empty(), "--mode hsdp with --pp ", options.pp,
                   " needs --mesh RxSxP (replicas x shards x pipeline ranks, P = ", options.pp,
                   ", product ", world.size, ")");
      const std::vector<int64_t> shape = mesh_shape_of(options.mesh);
      HP_CHECK_ARG(shape.size() == 3, "--mesh ", options.mesh, " with --pp ", options.pp,
                   " --mode hsdp: the mesh is R x S x P (replicas x shards x pipeline ranks), "
                   "three dims, but it has ", shape.size());
      HP_CHECK_ARG(shape[2] == options.pp, "--mesh ", options.mesh, " with --pp ", options.pp,
                   " --mode hsdp: the mesh is R x S x P with P the pipeline ranks, so its last "
                   "dim must be --pp ", options.pp, ", got ", shape[2]);
      const int64_t product = shape[0] * shape[1] * shape[2];
      HP_CHECK_ARG(product == world.size, "--mesh ", options.mesh, " with --pp ", options.pp,
                   " --mode hsdp holds ", plural(product, "rank"), ", but the world has ",
                   world.size, " (WORLD_SIZE); R x S x P must equal the world size");
      hsdp_replicas = shape[0];
      dp_size = shape[0] * shape[1];
    } else if (!options.mesh.empty()) {
      const std::vector<int64_t> shape = mesh_shape_of(options.mesh);
      std::vector<int64_t> expected = mode == ParallelMode::kFSDPTP ? std::vector<int64_t>{}
                                      : tensor_parallel ? std::vector<int64_t>{options.pp, tp_size}
                                                        : std::vector<int64_t>{dp_size, options.pp};
      if (mode == ParallelMode::kFSDPTP && shape.size() == 3 && shape[1] == options.pp &&
          shape[0] * shape[1] * shape[2] == world.size) {
        dp_size = shape[0];
        tp_size = shape[2];
        expected = shape;
      }
      HP_CHECK_ARG(mode != ParallelMode::kNone && shape == expected, "--mesh ", options.mesh,
                   " with --pp ", options.pp, ": the mesh is ", dims,
                   mode == ParallelMode::kFSDPTP
                       ? hp::cat(" with P = ", options.pp, " and a product of WORLD_SIZE ",
                                 world.size)
                       : hp::cat(" = ", fmt::format("{}", fmt::join(expected, "x"))),
                   " under --mode ", plan::mode_name(mode),
                   " (ddp and fsdp: D x P, hsdp: R x S x P, tp: P x T, fsdp_tp: D x P x T), or "
                   "leave --mesh out");
    } else {
      HP_CHECK_ARG(mode != ParallelMode::kFSDPTP, "--mode fsdp_tp with --pp ", options.pp,
                   " needs --mesh D x P x T (data-parallel x pipeline x tensor-parallel ranks, "
                   "product ", world.size, ")");
    }
    if (sharded || tensor_parallel) {
      // fully_shard over D ranks per stage (hsdp: over S, replicated R
      // times; the stages stay gathered through each step: docs/pipeline.md),
      // tensor parallelism over T.
      Parallelism p(mode, mode == ParallelMode::kFSDP ? std::vector<int64_t>{dp_size}
                          : hsdp ? std::vector<int64_t>{hsdp_replicas, dp_size / hsdp_replicas}
                          : mode == ParallelMode::kTP ? std::vector<int64_t>{tp_size}
                                                      : std::vector<int64_t>{dp_size, tp_size});
      p.param_dtype = options.param_dtype;
      p.reduce_dtype = options.reduce_dtype;
      // tp stages with fully_shard's flags: units over a data-parallel dim
      // of one rank, as tp's units in the other modes.
      p.tp_units = mode == ParallelMode::kTP && !options.fully_shard_flags.empty();
      return p;
    }
    if (replicas) {
      // The layout's data-parallel size is the replicas'. Each rank's
      // stages stay whole (no fully_shard units are made), unless given
      // fully_shard's flags: then units over (replicas, a shard of one).
      Parallelism p(ParallelMode::kDDP, {dp_size, 1});
      p.param_dtype = options.param_dtype;
      p.reduce_dtype = options.reduce_dtype;
      p.ddp_stage_units = !options.fully_shard_flags.empty();
      return p;
    }
    Parallelism p;
    p.param_dtype = options.param_dtype;
    return p;
  }
  const ParallelMode mode = options.mode_given
                                ? options.mode
                                : (world.launched ? ParallelMode::kFSDP : ParallelMode::kNone);
  Parallelism p(mode, resolve_mesh(mode, options, world));
  p.reshard_after_forward = options.reshard_after_forward;
  p.param_dtype = options.param_dtype;
  p.reduce_dtype = options.reduce_dtype;
  p.tp_units = mode == ParallelMode::kTP && !options.fully_shard_flags.empty();
  return p;
}

void validate_options(const TrainOptions& o, const Parallelism& parallelism) {
  HP_CHECK_ARG(o.d % o.heads == 0, "--heads ", o.heads, " must divide --d ", o.d,
               " (each head gets d / heads channels)");
  if (o.model == "llama") {
    // The rotary embedding turns pairs of a head's channels.
    HP_CHECK_ARG((o.d / o.heads) % 2 == 0, "--d ", o.d, " / --heads ", o.heads, " = ",
                 o.d / o.heads, " must be even for --model llama (rotary positions turn pairs "
                 "of a head's channels)");
    HP_CHECK_ARG(o.kv_heads == 0 || o.heads % o.kv_heads == 0, "--kv-heads ", o.kv_heads,
                 " must divide --heads ", o.heads, " (each key/value head serves a group of "
                 "query heads)");
  } else {
    HP_CHECK_ARG(o.kv_heads == 0, "--kv-heads ", o.kv_heads, " applies to --model llama only; "
                 "--model ", o.model, " has one key/value head per query head");
  }
  HP_CHECK_ARG(o.seq <= o.ctx, "--seq ", o.seq, " must be at most --ctx ", o.ctx,
               " (the model's context length)");
  using plan::ParallelMode;
  const char* mode = plan::mode_name(parallelism.mode);
  const int64_t dp_size = parallelism.dp_size();
  HP_CHECK_ARG(o.batch % dp_size == 0, "--batch ", o.batch,
               " (the global batch) must be divisible by the data-parallel size ", dp_size,
               " (", mode, " on ", plural(dp_size, "rank"), ")");
  if (parallelism.mode == ParallelMode::kNone) {
    // These configure fully_shard; a single process has none, and taking
    // them silently would train in another precision than asked for.
    HP_CHECK_ARG(o.fully_shard_flags.empty(), o.fully_shard_flags.front(),
                 " configures fully_shard and does not apply to --mode none (no fully_shard "
                 "units); leave it out, or use --mode fsdp, hsdp, ddp, tp or fsdp_tp");
  }
  const int64_t tp = parallelism.tp_size();
  const std::string mesh = fmt::format("{}", fmt::join(parallelism.mesh_shape, "x"));
  HP_CHECK_ARG(o.heads % tp == 0, "--heads ", o.heads, " must be divisible by the "
               "tensor-parallel size ", tp, " (--mode ", mode, " --mesh ", mesh,
               "): each rank computes whole heads");
  const int64_t kv_heads = o.kv_heads > 0 ? o.kv_heads : o.heads;
  HP_CHECK_ARG(kv_heads % tp == 0, "--kv-heads ", kv_heads, " must be divisible by the "
               "tensor-parallel size ", tp, " (--mode ", mode, " --mesh ", mesh,
               "): each rank holds whole key/value heads");
  const auto& reshard = parallelism.reshard_after_forward;
  const int64_t* group = reshard ? std::get_if<int64_t>(&*reshard) : nullptr;
  if (group && parallelism.mode != ParallelMode::kNone) {
    // The ranks fully_shard shards over: the mesh's last dim, the
    // data-parallel dim of fsdp_tp, none under DDP or tensor parallelism.
    const int64_t shard_size = parallelism.shard_size();
    HP_CHECK_ARG(shard_size % *group == 0 && *group <= shard_size, "--reshard-after-forward ",
                 *group, " must divide the shard group size ", shard_size, " of ", mode,
                 " on mesh ", to_string(parallelism.mesh_shape));
  }
  if (o.pp > 1) {
    const PipelineSchedule schedule = pipeline_schedule(o);
    HP_CHECK_ARG(schedule.stages() <= o.layers, "--pp ", o.pp, " x --pp-stages-per-rank ",
                 schedule.stages_per_rank, " = ", schedule.stages(), " stages exceed --layers ",
                 o.layers, ": every stage needs at least one block");
    try {
      pp::check_spec({pp::parse_schedule_kind(schedule.kind), static_cast<int>(schedule.ranks),
                      static_cast<int>(schedule.stages_per_rank),
                      static_cast<int>(schedule.microbatches)});
    } catch (const ArgumentError& e) {
      throw_argument_error(fmt::format("--pp-schedule {} --pp {} --pp-stages-per-rank {} "
                                       "--microbatches {}: {}",
                                       schedule.kind, schedule.ranks, schedule.stages_per_rank,
                                       schedule.microbatches, e.what()));
    }
    HP_CHECK_ARG(o.batch % (dp_size * schedule.microbatches) == 0, "--batch ", o.batch,
                 " must be a multiple of the ", schedule.microbatches,
                 " micro-batches of a pipeline step (--microbatches)",
                 dp_size > 1
                     ? fmt::format(" times the {} {}", dp_size,
                                   parallelism.mode == ParallelMode::kDDP ? "replicas"
                                                                          : "data-parallel ranks")
                     : std::string());
  } else {
    HP_CHECK_ARG(o.microbatches == 0 && o.pp_stages_per_rank == 0 && o.pp_split.empty() &&
                     o.pp_schedule == "1f1b",
                 "--pp-schedule, --microbatches, --pp-stages-per-rank and --pp-split configure "
                 "a pipeline and need --pp P with P > 1");
  }
  if (o.data_file.empty()) {
    HP_CHECK_ARG(o.vocab == 0 || o.vocab == 256, "--vocab ", o.vocab,
                 " does not fit the default corpus (fortunes as bytes: vocab 256); give "
                 "--data-file for other token ids");
  } else {
    HP_CHECK_ARG(o.vocab != 0, "--data-file ", o.data_file,
                 " needs --vocab V (every token id must be below V)");
  }
}

PipelineSchedule pipeline_schedule(const TrainOptions& o) {
  PipelineSchedule schedule;
  schedule.kind = o.pp_schedule;
  schedule.ranks = o.pp;
  const bool looped = o.pp_schedule == "interleaved" || o.pp_schedule == "zero-bubble";
  schedule.stages_per_rank = o.pp_stages_per_rank > 0 ? o.pp_stages_per_rank : (looped ? 2 : 1);
  HP_CHECK_ARG(looped || schedule.stages_per_rank == 1, "--pp-stages-per-rank ",
               schedule.stages_per_rank, " needs a looped schedule (--pp-schedule interleaved "
               "or zero-bubble); ", o.pp_schedule, " runs one stage per rank");
  schedule.microbatches = o.microbatches > 0 ? o.microbatches : 2 * schedule.stages();
  return schedule;
}

std::string resolve_device_type(const TrainOptions& o) {
  if (o.device.empty()) return compat::cuda_available() ? "cuda" : "cpu";
  if (o.device == "cuda") compat::require_cuda("--device cuda");
  return o.device;
}

bool uses_meta_init(const TrainOptions& o, const Parallelism& parallelism) {
  if (!o.init.empty()) return o.init == "meta";
  // Whole copies everywhere (one process, DDP): meta saves nothing.
  return parallelism.mode != plan::ParallelMode::kNone &&
         parallelism.mode != plan::ParallelMode::kDDP;
}

void validate_corpus(const TrainOptions& o, const Corpus& corpus) {
  const int64_t len = corpus.tokens.numel();
  HP_CHECK_ARG(len >= o.seq + 2, "--seq ", o.seq, " needs a corpus of at least seq + 2 = ",
               o.seq + 2, " tokens, but ", corpus.description, " has ", len);
}

}  // namespace hp::train
