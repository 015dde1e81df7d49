#include "tools/hp_train/train_options.h"

#include <CLI/CLI.hpp>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <numeric>
#include <tuple>

#include "hp/util/error.h"
#include "hp/util/format.h"

namespace hp::train {
namespace {

// Values are read as strings and converted here rather than by CLI11, so
// every message has the same shape: flag, value, expectation.
int64_t parse_int(const std::string& flag, const std::string& value, int64_t min,
                  const char* expected) {
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value.c_str(), &end, 10);
  const bool is_integer = !value.empty() && (std::isdigit(static_cast<unsigned char>(value[0])) ||
                                             value[0] == '-') &&
                          *end == '\0' && errno == 0;
  HP_CHECK_ARG(is_integer && parsed >= min, flag, " must be ", expected, ", got '", value, "'");
  return parsed;
}

double parse_double(const std::string& flag, const std::string& value, bool allow_zero,
                    const char* expected) {
  char* end = nullptr;
  errno = 0;
  const double parsed = std::strtod(value.c_str(), &end);
  const bool ok = !value.empty() && *end == '\0' && errno == 0 && std::isfinite(parsed) &&
                  (parsed > 0 || (allow_zero && parsed == 0));
  HP_CHECK_ARG(ok, flag, " must be ", expected, ", got '", value, "'");
  return parsed;
}

uint64_t parse_seed(const std::string& value) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long parsed = std::strtoull(value.c_str(), &end, 10);
  HP_CHECK_ARG(!value.empty() && std::isdigit(static_cast<unsigned char>(value[0])) &&
                   *end == '\0' && errno == 0,
               "--seed must be a non-negative integer below 2^64, got '", value, "'");
  return parsed;
}

Mode parse_mode(const std::string& value) {
  if (value == "none") return Mode::kNone;
  if (value == "fsdp") return Mode::kFSDP;
  if (value == "hsdp") return Mode::kHSDP;
  if (value == "ddp") return Mode::kDDP;
  throw_argument_error(cat("--mode must be one of fsdp, hsdp, ddp, none, got '", value, "'"));
}

// "4" -> {4}, "2x2" -> {2, 2}.
std::vector<int64_t> parse_mesh(const std::string& value) {
  const std::string expected = cat("--mesh must be N or RxS with positive integers (e.g. 4 or ",
                                   "2x2), got '", value, "'");
  std::vector<int64_t> shape;
  size_t begin = 0;
  while (true) {
    const size_t x = value.find('x', begin);
    const std::string part = value.substr(begin, x == std::string::npos ? x : x - begin);
    char* end = nullptr;
    errno = 0;
    const long long n = std::strtoll(part.c_str(), &end, 10);
    HP_CHECK_ARG(!part.empty() && std::isdigit(static_cast<unsigned char>(part[0])) &&
                     *end == '\0' && errno == 0 && n >= 1,
                 expected);
    shape.push_back(n);
    if (x == std::string::npos) break;
    begin = x + 1;
  }
  HP_CHECK_ARG(shape.size() <= 2, expected);
  return shape;
}

std::string mesh_text(const std::vector<int64_t>& shape) {
  std::string text;
  for (size_t i = 0; i < shape.size(); ++i) text += cat(i ? "x" : "", shape[i]);
  return text;
}

}  // namespace

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kNone:
      return "none";
    case Mode::kFSDP:
      return "fsdp";
    case Mode::kHSDP:
      return "hsdp";
    case Mode::kDDP:
      return "ddp";
  }
  return "?";
}

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CLI::App app{"Trains a GPT with AdamW on a real corpus (Debian's fortunes by default), on one "
               "process or on the ranks of hprun with FSDP, HSDP or DDP.",
               "hp-train"};
  app.footer(
      "Examples:\n"
      "  hprun -n 2 hp-train                      FSDP on 2 ranks, the default config\n"
      "  hprun -n 4 hp-train --mode hsdp --mesh 2x2\n"
      "  hp-train --mode none --steps 50          one process\n"
      "Every flag is validated before any communication; errors name the flag.\n");

  const TrainOptions defaults;
  std::map<std::string, std::string> values;
  // Each flag: name, value name, help. Defaults are shown in the help text.
  const std::vector<std::tuple<std::string, std::string, std::string>> flags = {
      {"--layers", "L", cat("transformer blocks (default ", defaults.layers, ")")},
      {"--d", "D", cat("model width (default ", defaults.d, ")")},
      {"--heads", "H", cat("attention heads, dividing --d (default ", defaults.heads, ")")},
      {"--ctx", "C", cat("context length of the model (default ", defaults.ctx, ")")},
      {"--data-file", "FILE", "raw little-endian uint16 tokens (default: fortunes as bytes)"},
      {"--vocab", "V", "vocabulary size; required with --data-file (bytes: 256)"},
      {"--batch", "B", cat("GLOBAL batch, split over data-parallel ranks (default ",
                           defaults.batch, ")")},
      {"--seq", "T", cat("tokens per sample, at most --ctx (default ", defaults.seq, ")")},
      {"--steps", "S", cat("optimizer steps (default ", defaults.steps, ")")},
      {"--lr", "X", cat("constant AdamW learning rate (default ", defaults.lr, ")")},
      {"--weight-decay", "W", cat("AdamW weight decay, all parameters (default ",
                                  defaults.weight_decay, ")")},
      {"--grad-clip", "C", cat("clip the global gradient norm; 0 disables (default ",
                               defaults.grad_clip, ")")},
      {"--seed", "S", cat("seeds the weights and the sample (default ", defaults.seed, ")")},
      {"--mode", "M", "fsdp | hsdp | ddp | none (default: fsdp under a launcher, else none)"},
      {"--mesh", "N|RxS", "mesh shape; its product is the world size (default: world size)"},
      {"--init-from", "FILE", "initial weights (.safetensors) by parameter name"},
      {"--log-json", "FILE", "rank 0 writes one JSON object per step"},
      {"--threads", "N", cat("torch intra-op threads per rank (default ", defaults.threads, ")")},
      {"--log-every", "N", cat("progress line every N steps (default ", defaults.log_every, ")")},
      {"--sample-tokens", "N", cat("tokens to sample at the end; 0 disables (default ",
                                   defaults.sample_tokens, ")")},
      {"--temperature", "X", cat("sampling temperature (default ", defaults.temperature, ")")},
      {"--top-k", "K", cat("sample among the K likeliest tokens; 0 = all (default ",
                           defaults.top_k, ")")},
      {"--reshard-after-forward", "true|false|N",
       "after forward, free gathered parameters (true, default), keep them (false), or keep "
       "them gathered within groups of N ranks"},
      {"--param-dtype", "bf16|fp16|fp32", "compute and all-gather dtype (default fp32)"},
      {"--reduce-dtype", "bf16|fp16|fp32", "gradient reduction dtype (default: --param-dtype)"},
      {"--trace", "FILE", "Chrome trace JSON per rank: FILE with .rank<r> before the extension"},
  };
  for (const auto& [name, type, help] : flags) {
    // A repeated flag takes its last value, so a script can append overrides.
    app.add_option(name, values[name], help)
        ->type_name(type)
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  }

  bool comm_fusion = false, no_prefetch = false;
  app.add_flag("--comm-fusion", comm_fusion,
               "one all-gather and one reduce-scatter per unit (zero-copy flat buffers)");
  app.add_flag("--no-prefetch", no_prefetch,
               "do not gather the next unit while this one computes");

  CommandLine result;
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11's convention
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    result.help_requested = true;
    result.help_text = app.help();
    return result;
  } catch (const CLI::ParseError& e) {
    throw_argument_error(cat(e.what(), "; see hp-train --help"));
  }

  TrainOptions& o = result.options;
  auto given = [&](const std::string& name) { return app.count(name) > 0; };
  auto positive = [&](const std::string& name, int64_t& field) {
    if (given(name)) field = parse_int(name, values[name], 1, "a positive integer");
  };
  auto non_negative = [&](const std::string& name, int64_t& field) {
    if (given(name)) field = parse_int(name, values[name], 0, "a non-negative integer");
  };
  positive("--layers", o.layers);
  positive("--d", o.d);
  positive("--heads", o.heads);
  positive("--ctx", o.ctx);
  positive("--batch", o.batch);
  positive("--seq", o.seq);
  positive("--steps", o.steps);
  positive("--log-every", o.log_every);
  non_negative("--sample-tokens", o.sample_tokens);
  non_negative("--top-k", o.top_k);
  if (given("--vocab")) {
    o.vocab = parse_int("--vocab", values["--vocab"], 1, "a positive integer");
    HP_CHECK_ARG(o.vocab <= 65536, "--vocab must be at most 65536 (uint16 tokens), got '",
                 values["--vocab"], "'");
  }
  if (given("--threads")) {
    const int64_t threads = parse_int("--threads", values["--threads"], 1, "a positive integer");
    HP_CHECK_ARG(threads <= 1024, "--threads must be at most 1024, got '", values["--threads"],
                 "'");
    o.threads = static_cast<int>(threads);
  }
  if (given("--lr")) o.lr = parse_double("--lr", values["--lr"], false, "a positive number");
  if (given("--weight-decay")) {
    o.weight_decay = parse_double("--weight-decay", values["--weight-decay"], true,
                                  "a non-negative number");
  }
  if (given("--grad-clip")) {
    o.grad_clip = parse_double("--grad-clip", values["--grad-clip"], true,
                               "a non-negative number (0 disables clipping)");
  }
  if (given("--temperature")) {
    o.temperature =
        parse_double("--temperature", values["--temperature"], false, "a positive number");
  }
  if (given("--seed")) o.seed = parse_seed(values["--seed"]);
  if (given("--mode")) {
    o.mode = parse_mode(values["--mode"]);
    o.mode_given = true;
  }
  if (given("--mesh")) {
    parse_mesh(values["--mesh"]);  // the form is checked now, the fit in resolve_parallelism
    o.mesh = values["--mesh"];
  }
  o.comm_fusion = comm_fusion;
  o.prefetch = !no_prefetch;
  if (given("--reshard-after-forward")) {
    const std::string& v = values["--reshard-after-forward"];
    if (v == "true") {
      o.reshard_after_forward = -1;
    } else if (v == "false") {
      o.reshard_after_forward = 0;
    } else {
      o.reshard_after_forward = parse_int("--reshard-after-forward", v, 1,
                                          "true, false or a positive number of ranks");
    }
  }
  for (const auto& [name, field] : {std::make_pair("--param-dtype", &o.param_dtype),
                                    std::make_pair("--reduce-dtype", &o.reduce_dtype)}) {
    if (!given(name)) continue;
    const std::string& v = values[name];
    HP_CHECK_ARG(v == "bf16" || v == "fp16" || v == "fp32", name,
                 " must be one of bf16, fp16, fp32, got '", v, "'");
    *field = v;
  }
  for (const auto& [name, field] : {std::make_pair("--data-file", &o.data_file),
                                    std::make_pair("--init-from", &o.init_from),
                                    std::make_pair("--log-json", &o.log_json),
                                    std::make_pair("--trace", &o.trace)}) {
    if (!given(name)) continue;
    HP_CHECK_ARG(!values[name].empty(), name, " must name a file, got ''");
    *field = values[name];
  }
  return result;
}

std::string Parallelism::describe() const {
  if (mode == Mode::kNone) return "none (one process, no process group)";
  std::string text = cat(mode_name(mode), " on mesh ", to_string(mesh_shape), " ",
                         to_string(mesh_names));
  switch (mode) {
    case Mode::kFSDP:
      text += cat(": parameters sharded over ", mesh_shape[0], " ranks");
      break;
    case Mode::kHSDP:
      text += cat(": ", mesh_shape[0], " replicas, each sharded over ", mesh_shape[1], " ranks");
      break;
    case Mode::kDDP:
      text += cat(": parameters replicated on ", mesh_shape[0], " ranks");
      break;
    case Mode::kNone:
      break;
  }
  return text + cat(", data-parallel size ", dp_size);
}

Parallelism resolve_parallelism(const TrainOptions& options, const World& world) {
  Parallelism p;
  p.mode = options.mode_given ? options.mode : (world.launched ? Mode::kFSDP : Mode::kNone);
  const std::string mode = mode_name(p.mode);
  const std::vector<int64_t> shape = options.mesh.empty()
                                         ? std::vector<int64_t>{world.size}
                                         : parse_mesh(options.mesh);

  if (p.mode == Mode::kNone) {
    HP_CHECK_ARG(world.size == 1, "--mode none trains in one process, but WORLD_SIZE is ",
                 world.size, "; use --mode fsdp, hsdp or ddp with several ranks, or start one "
                 "process");
    HP_CHECK_ARG(shape == std::vector<int64_t>{1}, "--mesh ", options.mesh,
                 " does not apply to --mode none, which runs one process; leave --mesh out");
    return p;
  }
  HP_CHECK_ARG(world.launched, "--mode ", mode,
               " needs one process per rank started by a launcher (hprun -n N hp-train ...: "
               "RANK and WORLD_SIZE are not set); use --mode none for a single process");
  if (p.mode == Mode::kHSDP) {
    HP_CHECK_ARG(!options.mesh.empty(), "--mode hsdp needs --mesh RxS (replicas x shards, "
                 "R*S = the world size ", world.size, ")");
    HP_CHECK_ARG(shape.size() == 2, "--mode hsdp needs a 2-D mesh RxS (replicas x shards), got "
                 "--mesh ", options.mesh);
  } else {
    HP_CHECK_ARG(shape.size() == 1, "--mode ", mode, " needs a 1-D mesh N, got --mesh ",
                 options.mesh, " (a 2-D mesh RxS is --mode hsdp)");
  }
  const int64_t product = std::accumulate(shape.begin(), shape.end(), int64_t{1},
                                          std::multiplies<int64_t>());
  HP_CHECK_ARG(product == world.size, "--mesh ", mesh_text(shape), " holds ", product,
               " ranks, but the world has ", world.size,
               " (WORLD_SIZE); the mesh's product must equal the world size");
  switch (p.mode) {
    case Mode::kFSDP:
      p.mesh_shape = shape;
      p.mesh_names = {"shard"};
      break;
    case Mode::kHSDP:
      p.mesh_shape = shape;
      p.mesh_names = {"replicate", "shard"};
      break;
    case Mode::kDDP:
      // fully_shard's DDP: a replicate dim over every rank, a shard dim of one.
      p.mesh_shape = {shape[0], 1};
      p.mesh_names = {"replicate", "shard"};
      break;
    case Mode::kNone:
      break;
  }
  p.dp_size = world.size;
  return p;
}

void validate_options(const TrainOptions& o, const Parallelism& parallelism) {
  HP_CHECK_ARG(o.d % o.heads == 0, "--heads ", o.heads, " must divide --d ", o.d,
               " (each head gets d / heads channels)");
  HP_CHECK_ARG(o.seq <= o.ctx, "--seq ", o.seq, " must be at most --ctx ", o.ctx,
               " (the model's context length)");
  HP_CHECK_ARG(o.batch % parallelism.dp_size == 0, "--batch ", o.batch,
               " (the global batch) must be divisible by the data-parallel size ",
               parallelism.dp_size, " (", mode_name(parallelism.mode), " on ",
               parallelism.dp_size, " ranks)");
  if (parallelism.mode == Mode::kNone) {
    // These configure fully_shard; a single process has none, and taking
    // them silently would train in another precision than asked for.
    const char* flag = o.comm_fusion                   ? "--comm-fusion"
                       : !o.prefetch                   ? "--no-prefetch"
                       : o.reshard_after_forward != -1 ? "--reshard-after-forward"
                       : o.param_dtype != "fp32"       ? "--param-dtype"
                       : !o.reduce_dtype.empty()       ? "--reduce-dtype"
                                                       : nullptr;
    HP_CHECK_ARG(flag == nullptr, flag, " configures fully_shard and does not apply to --mode "
                 "none (one process, plain libtorch); leave it out, or start ranks with hprun "
                 "and --mode fsdp, hsdp or ddp");
  }
  if (o.reshard_after_forward > 0 && parallelism.mode != Mode::kNone) {
    const int64_t shard_size =
        parallelism.mode == Mode::kDDP ? 1 : parallelism.mesh_shape.back();
    HP_CHECK_ARG(shard_size % o.reshard_after_forward == 0 &&
                     o.reshard_after_forward <= shard_size,
                 "--reshard-after-forward ", o.reshard_after_forward,
                 " must divide the shard group size ", shard_size, " of ",
                 mode_name(parallelism.mode), " on mesh ", to_string(parallelism.mesh_shape));
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

void validate_corpus(const TrainOptions& o, const Corpus& corpus) {
  const int64_t len = corpus.tokens.numel();
  HP_CHECK_ARG(len >= o.seq + 2, "--seq ", o.seq, " needs a corpus of at least seq + 2 = ",
               o.seq + 2, " tokens, but ", corpus.description, " has ", len);
}

}  // namespace hp::train
