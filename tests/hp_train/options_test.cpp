// hp-train in-process: flag parsing and validation (each error names the
// flag, the value and the expectation), mode/mesh defaults, the progress
// display and --init-from's loader.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/nn/gpt.h"
#include "hp/util/error.h"
#include "tests/launcher/process_runner.h"
#include "tests/support/tensor_checks.h"
#include "tools/hp_train/init_weights.h"
#include "tools/hp_train/progress.h"
#include "tools/hp_train/report.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {
namespace {

using Args = std::vector<std::string>;

void expect_contains(const std::string& message, const std::string& part) {
  EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
}

World launched(int size) { return {true, 0, size}; }
const World kAlone{false, 0, 1};

// The verdict of everything checked before the process group: the message
// of the first error, or "" when the flags are accepted.
std::string check(const Args& args, const World& world) {
  try {
    const TrainOptions o = parse_command_line(args).options;
    validate_options(o, resolve_parallelism(o, world));
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "";
}

TEST(Flags, DefaultsFollowTheWorld) {
  const TrainOptions defaults = parse_command_line({}).options;
  Parallelism alone = resolve_parallelism(defaults, kAlone);
  EXPECT_EQ(alone.mode, Mode::kNone);
  EXPECT_EQ(alone.dp_size, 1);
  EXPECT_TRUE(alone.mesh_shape.empty());

  Parallelism two = resolve_parallelism(defaults, launched(2));
  EXPECT_EQ(two.mode, Mode::kFSDP);
  EXPECT_EQ(two.mesh_shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(two.dp_size, 2);

  const TrainOptions ddp = parse_command_line({"--mode", "ddp"}).options;
  Parallelism d = resolve_parallelism(ddp, launched(2));
  EXPECT_EQ(d.mesh_shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(d.mesh_names, (std::vector<std::string>{"replicate", "shard"}));

  const TrainOptions hsdp = parse_command_line({"--mode", "hsdp", "--mesh", "2x2"}).options;
  Parallelism h = resolve_parallelism(hsdp, launched(4));
  EXPECT_EQ(h.mesh_shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(h.dp_size, 4);
  expect_contains(h.describe(), "2 replicas, each sharded over 2 ranks");

  // A launched world of one may still train without a process group.
  EXPECT_EQ(resolve_parallelism(parse_command_line({"--mode", "none"}).options, launched(1)).mode,
            Mode::kNone);
}

TEST(Flags, ValuesAreParsed) {
  const TrainOptions o =
      parse_command_line({"--layers", "3", "--d", "48", "--heads", "6", "--ctx", "32", "--batch",
                          "8", "--seq", "32", "--steps", "7", "--lr", "1e-3", "--weight-decay",
                          "0", "--grad-clip", "0", "--seed", "18446744073709551615", "--threads",
                          "2", "--log-every", "3", "--sample-tokens", "0", "--temperature", "1.5",
                          "--top-k", "0", "--log-json", "/tmp/x.jsonl", "--init-from", "w.st",
                          "--data-file", "t.bin", "--vocab", "1000"})
          .options;
  EXPECT_EQ(o.layers, 3);
  EXPECT_EQ(o.d, 48);
  EXPECT_EQ(o.heads, 6);
  EXPECT_EQ(o.ctx, 32);
  EXPECT_EQ(o.batch, 8);
  EXPECT_EQ(o.seq, 32);
  EXPECT_EQ(o.steps, 7);
  EXPECT_DOUBLE_EQ(o.lr, 1e-3);
  EXPECT_EQ(o.weight_decay, 0);
  EXPECT_EQ(o.grad_clip, 0);
  EXPECT_EQ(o.seed, UINT64_MAX);
  EXPECT_EQ(o.threads, 2);
  EXPECT_EQ(o.log_every, 3);
  EXPECT_EQ(o.sample_tokens, 0);
  EXPECT_DOUBLE_EQ(o.temperature, 1.5);
  EXPECT_EQ(o.top_k, 0);
  EXPECT_EQ(o.log_json, "/tmp/x.jsonl");
  EXPECT_EQ(o.init_from, "w.st");
  EXPECT_EQ(o.data_file, "t.bin");
  EXPECT_EQ(o.vocab, 1000);
  EXPECT_EQ(check({"--heads", "6", "--d", "48"}, launched(2)), "");

  // fully_shard's flags; the defaults are reshard after forward, prefetch
  // on, fusion off, fp32 everywhere.
  const TrainOptions defaults = parse_command_line({}).options;
  EXPECT_FALSE(defaults.comm_fusion);
  EXPECT_TRUE(defaults.prefetch);
  EXPECT_EQ(defaults.reshard_after_forward, -1);
  EXPECT_EQ(defaults.param_dtype, "fp32");
  EXPECT_EQ(defaults.reduce_dtype, "");
  const TrainOptions perf =
      parse_command_line({"--comm-fusion", "--no-prefetch", "--reshard-after-forward", "2",
                          "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--trace", "t.json"})
          .options;
  EXPECT_TRUE(perf.comm_fusion);
  EXPECT_FALSE(perf.prefetch);
  EXPECT_EQ(perf.reshard_after_forward, 2);
  EXPECT_EQ(perf.param_dtype, "bf16");
  EXPECT_EQ(perf.reduce_dtype, "fp32");
  EXPECT_EQ(perf.trace, "t.json");
  EXPECT_EQ(parse_command_line({"--reshard-after-forward", "false"}).options.reshard_after_forward,
            0);
  EXPECT_EQ(parse_command_line({"--reshard-after-forward", "true"}).options.reshard_after_forward,
            -1);
  // The last of a repeated flag wins.
  EXPECT_EQ(parse_command_line({"--steps", "3", "--steps", "9"}).options.steps, 9);
}

TEST(Flags, BadValuesNameFlagValueAndExpectation) {
  const std::vector<std::pair<Args, std::string>> cases = {
      {{"--batch", "0"}, "--batch must be a positive integer, got '0'"},
      {{"--batch", "abc"}, "--batch must be a positive integer, got 'abc'"},
      {{"--steps", "-3"}, "--steps must be a positive integer, got '-3'"},
      {{"--layers", "2.5"}, "--layers must be a positive integer, got '2.5'"},
      {{"--lr", "-1"}, "--lr must be a positive number, got '-1'"},
      {{"--lr", "nan"}, "--lr must be a positive number, got 'nan'"},
      {{"--weight-decay", "-0.1"}, "--weight-decay must be a non-negative number, got '-0.1'"},
      {{"--grad-clip", "x"}, "--grad-clip must be a non-negative number (0 disables clipping)"},
      {{"--temperature", "0"}, "--temperature must be a positive number, got '0'"},
      {{"--top-k", "-1"}, "--top-k must be a non-negative integer, got '-1'"},
      {{"--threads", "0"}, "--threads must be a positive integer, got '0'"},
      {{"--seed", "-1"}, "--seed must be a non-negative integer below 2^64, got '-1'"},
      {{"--vocab", "70000"}, "--vocab must be at most 65536 (uint16 tokens), got '70000'"},
      {{"--mode", "zero3"}, "--mode must be one of fsdp, hsdp, ddp, none, got 'zero3'"},
      {{"--mesh", "2x"}, "--mesh must be N or RxS with positive integers (e.g. 4 or 2x2), got '2x'"},
      {{"--mesh", "0"}, "got '0'"},
      {{"--mesh", "2x2x1"}, "got '2x2x1'"},
      {{"--log-json", ""}, "--log-json must name a file, got ''"},
      {{"--trace", ""}, "--trace must name a file, got ''"},
      {{"--reshard-after-forward", "yes"},
       "--reshard-after-forward must be true, false or a positive number of ranks, got 'yes'"},
      {{"--reshard-after-forward", "0"}, "got '0'"},
      {{"--param-dtype", "fp8"}, "--param-dtype must be one of bf16, fp16, fp32, got 'fp8'"},
      {{"--reduce-dtype", "int8"}, "--reduce-dtype must be one of bf16, fp16, fp32, got 'int8'"},
      {{"--bogus"}, "--bogus"},
  };
  for (const auto& [args, expected] : cases) {
    SCOPED_TRACE(args[0]);
    expect_contains(check(args, launched(2)), expected);
  }
}

TEST(Flags, CombinationsAreCheckedAgainstTheWorld) {
  expect_contains(check({"--batch", "6"}, launched(4)),
                  "--batch 6 (the global batch) must be divisible by the data-parallel size 4");
  expect_contains(check({"--mode", "ddp", "--batch", "3"}, launched(2)),
                  "data-parallel size 2 (ddp on 2 ranks)");
  expect_contains(check({"--heads", "3", "--d", "32"}, kAlone), "--heads 3 must divide --d 32");
  expect_contains(check({"--seq", "100", "--ctx", "64"}, kAlone),
                  "--seq 100 must be at most --ctx 64");
  expect_contains(check({"--vocab", "300"}, kAlone),
                  "--vocab 300 does not fit the default corpus (fortunes as bytes: vocab 256)");
  EXPECT_EQ(check({"--vocab", "256"}, kAlone), "");
  expect_contains(check({"--data-file", "t.bin"}, kAlone),
                  "--data-file t.bin needs --vocab V");
  expect_contains(check({"--mode", "fsdp", "--mesh", "2x2"}, launched(4)),
                  "--mode fsdp needs a 1-D mesh N, got --mesh 2x2");
  expect_contains(check({"--mode", "ddp", "--mesh", "2x1"}, launched(2)),
                  "--mode ddp needs a 1-D mesh N, got --mesh 2x1");
  expect_contains(check({"--mode", "hsdp"}, launched(4)),
                  "--mode hsdp needs --mesh RxS (replicas x shards, R*S = the world size 4)");
  expect_contains(check({"--mode", "hsdp", "--mesh", "4"}, launched(4)),
                  "--mode hsdp needs a 2-D mesh RxS (replicas x shards), got --mesh 4");
  expect_contains(check({"--mesh", "3"}, launched(2)),
                  "--mesh 3 holds 3 ranks, but the world has 2 (WORLD_SIZE)");
  expect_contains(check({"--mode", "hsdp", "--mesh", "2x2"}, launched(2)),
                  "--mesh 2x2 holds 4 ranks, but the world has 2");
  expect_contains(check({"--mode", "none"}, launched(2)),
                  "--mode none trains in one process, but WORLD_SIZE is 2");
  expect_contains(check({"--mode", "none", "--mesh", "2"}, kAlone),
                  "--mesh 2 does not apply to --mode none");
  expect_contains(check({"--mode", "fsdp"}, kAlone),
                  "--mode fsdp needs one process per rank started by a launcher");
  // fully_shard's flags need fully_shard.
  for (const Args& args : {Args{"--comm-fusion"}, Args{"--no-prefetch"},
                           Args{"--reshard-after-forward", "false"},
                           Args{"--param-dtype", "bf16"}, Args{"--reduce-dtype", "fp32"}}) {
    expect_contains(check(args, kAlone), args[0] + " configures fully_shard and does not apply "
                                                   "to --mode none");
  }
  EXPECT_EQ(check({"--param-dtype", "fp32"}, kAlone), "");
  expect_contains(check({"--reshard-after-forward", "3"}, launched(2)),
                  "--reshard-after-forward 3 must divide the shard group size 2 of fsdp on mesh "
                  "[2]");
  expect_contains(check({"--mode", "hsdp", "--mesh", "2x2", "--reshard-after-forward", "4"},
                        launched(4)),
                  "--reshard-after-forward 4 must divide the shard group size 2 of hsdp");
  EXPECT_EQ(check({"--reshard-after-forward", "2"}, launched(4)), "");
}

TEST(Flags, CorpusMustHoldOneWindow) {
  TrainOptions o;
  o.seq = 8;
  Corpus corpus{at::arange(9, at::kLong), 256, "tiny.bin: 9 uint16 tokens"};
  expect_contains(test::message_of<ArgumentError>([&] { validate_corpus(o, corpus); }),
                  "--seq 8 needs a corpus of at least seq + 2 = 10 tokens, but tiny.bin: 9 "
                  "uint16 tokens has 9");
  corpus.tokens = at::arange(10, at::kLong);
  validate_corpus(o, corpus);
}

TEST(Progress, LineShowsStepLossSpeedAndEta) {
  ProgressMeter meter(300, 1000, /*window=*/2);
  meter.record(5.0);  // a slow first step leaves the window
  for (int i = 1; i < 120; ++i) meter.record(0.25);
  EXPECT_EQ(meter.line(2.34123), "step 120/300 | loss 2.3412 | 4.0k tok/s | 0.25 s/step | ETA 0:45");
  ProgressMeter short_run(5, 10);
  short_run.record(0.5);
  EXPECT_EQ(short_run.line(5.5), "step 1/5 | loss 5.5000 | 20 tok/s | 0.50 s/step | ETA 0:02");
}

TEST(Progress, HumanUnits) {
  EXPECT_EQ(human_count(950), "950");
  EXPECT_EQ(human_count(15234), "15.2k");
  EXPECT_EQ(human_count(2.5e6), "2.50M");
  EXPECT_EQ(human_bytes(512), "512 B");
  EXPECT_EQ(human_bytes(2048), "2.0 KiB");
  EXPECT_EQ(human_bytes(13002342), "12.4 MiB");
  EXPECT_EQ(clock_time(45), "0:45");
  EXPECT_EQ(clock_time(754), "12:34");
  EXPECT_EQ(clock_time(3723), "1:02:03");
}

TEST(Report, TokensRenderAsBytesOrIds) {
  EXPECT_EQ(render_tokens(at::tensor({'H', 'i', '\n', 1, '\t', '!'}, at::kLong), 256),
            "Hi\n?\t!");
  EXPECT_EQ(render_tokens(at::tensor({3, 0, 999}, at::kLong), 1000), "3 0 999");
  expect_contains(summary_line(5.5, 2.25, 300, 151, 2040), "loss 5.5000 -> 2.2500");
  expect_contains(memory_table({1 << 20, 2 << 20}, 1000), "rank 1: 2.0 MiB (2097152 bytes)");
}

// --init-from in-process: the file of one seed's model turns another seed's
// model into it; any mismatch names the file and the tensor.
class InitFrom : public testing::Test {
 protected:
  static nn::GPTConfig config() {
    nn::GPTConfig c;
    c.vocab_size = 256;
    c.context = 16;
    c.n_layer = 2;
    c.n_head = 2;
    c.n_embd = 32;
    return c;
  }
  static nn::GPT model(uint64_t seed) {
    torch::manual_seed(seed);
    return nn::GPT(config());
  }
  static std::vector<std::pair<std::string, at::Tensor>> weights(nn::GPT& m) {
    std::vector<std::pair<std::string, at::Tensor>> out;
    for (const auto& p : m->named_parameters()) out.emplace_back(p.key(), p.value().detach());
    return out;
  }
  std::string write(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
    const std::string path = dir_.file("w" + std::to_string(files_++) + ".safetensors");
    checkpoint::write_safetensors(path, tensors);
    return path;
  }
  std::string error(const std::string& path) {
    nn::GPT target = model(2);
    const nn::GPT untouched = model(2);  // the same weights, never loaded into
    std::string message =
        test::message_of<ArgumentError>([&] { load_initial_weights(*target, path); });
    const auto expected = untouched->named_parameters();
    for (const auto& p : target->named_parameters()) {  // nothing copied on failure
      EXPECT_TRUE(test::tensors_equal(p.value(), expected[p.key()])) << p.key();
    }
    return message;
  }

  launcher::testing::TempDir dir_;
  int files_ = 0;
};

TEST_F(InitFrom, LoadsEveryParameterByName) {
  nn::GPT source = model(1);
  const std::string path = write(weights(source));
  nn::GPT target = model(2);
  load_initial_weights(*target, path);
  for (const auto& [name, tensor] : weights(source)) {
    EXPECT_TRUE(test::tensors_equal(target->named_parameters()[name], tensor)) << name;
  }
  // Other floating dtypes are converted.
  auto doubles = weights(source);
  for (auto& [name, tensor] : doubles) tensor = tensor.to(at::kDouble);
  nn::GPT again = model(3);
  load_initial_weights(*again, write(doubles));
  EXPECT_TRUE(test::tensors_equal(again->wte->weight, source->wte->weight));
}

TEST_F(InitFrom, MismatchesNameTheFileAndTheTensor) {
  nn::GPT source = model(1);
  auto all = weights(source);

  auto missing = all;
  missing.erase(missing.begin() + 3);
  std::string path = write(missing);
  std::string m = error(path);
  expect_contains(m, "--init-from '" + path + "' does not match the model");
  expect_contains(m, "missing tensor '" + all[3].first + "' (expected shape [");

  auto extra = all;
  extra.emplace_back("h.9.mlp.c_fc.weight", at::zeros({4, 4}));
  m = error(write(extra));
  expect_contains(m, "unexpected tensor 'h.9.mlp.c_fc.weight' of shape [4, 4]");

  auto reshaped = all;
  for (auto& [name, tensor] : reshaped) {
    if (name == "wte.weight") tensor = at::zeros({300, 32});
  }
  m = error(write(reshaped));
  expect_contains(m, "tensor 'wte.weight' has shape [300, 32], expected [256, 32]");

  auto integers = all;
  integers[0].second = integers[0].second.to(at::kInt);
  m = error(write(integers));
  expect_contains(m, "tensor '" + all[0].first + "' has dtype Int, expected a floating dtype");

  m = error(dir_.file("absent.safetensors"));
  expect_contains(m, "--init-from: ");
  expect_contains(m, "absent.safetensors");
}

}  // namespace
}  // namespace hp::train
