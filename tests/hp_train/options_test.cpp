// hp-train in-process: flag parsing and validation (each error names the
// flag, the value and the expectation), mode/mesh defaults, the progress
// display and --init-from's loader.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/nn/gpt.h"
#include "hp/util/error.h"
#include "hp/util/torch_compat.h"
#include "hp/util/trace.h"
#include "tools/hp_train/checkpointing.h"
#include "tools/hp_train/init_weights.h"
#include "tools/hp_train/model.h"
#include "tools/hp_train/model_flops.h"
#include "tools/hp_train/output_file.h"
#include "tools/hp_train/progress.h"
#include "tools/hp_train/report.h"
#include "tools/hp_train/step_log.h"
#include "tools/hp_train/train_device.h"
#include "tools/hp_train/train_options.h"
#include "tests/launcher/process_runner.h"
#include "tests/support/model_configs.h"
#include "tests/support/tensor_checks.h"

namespace hp::train {
namespace {

using Args = std::vector<std::string>;
using testing::AllOf;
using testing::HasSubstr;
using testing::ThrowsMessage;

World launched(int size) { return {true, 0, size}; }
const World kAlone{false, 0, 1};

// The verdict of everything checked before the process group: the message
// of the first error, or "" when the flags are accepted.
std::string check(const Args& args, const World& world) {
  try {
    const TrainOptions o = parse_command_line(args).options;
    const Parallelism parallelism = resolve_parallelism(o, world);
    validate_options(o, parallelism);
    validate_checkpoint_options(o, parallelism);
  } catch (const ArgumentError& e) {
    return e.what();
  }
  return "";
}

TEST(Flags, DefaultsFollowTheWorld) {
  const TrainOptions defaults = parse_command_line({}).options;
  Parallelism alone = resolve_parallelism(defaults, kAlone);
  EXPECT_EQ(alone.mode, plan::ParallelMode::kNone);
  EXPECT_EQ(alone.dp_size(), 1);
  EXPECT_TRUE(alone.mesh_shape.empty());

  Parallelism two = resolve_parallelism(defaults, launched(2));
  EXPECT_EQ(two.mode, plan::ParallelMode::kFSDP);
  EXPECT_EQ(two.mesh_shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(two.dp_size(), 2);

  const TrainOptions ddp = parse_command_line({"--mode", "ddp"}).options;
  Parallelism d = resolve_parallelism(ddp, launched(2));
  EXPECT_EQ(d.mesh_shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(d.mesh_names, (std::vector<std::string>{"replicate", "shard"}));

  const TrainOptions hsdp = parse_command_line({"--mode", "hsdp", "--mesh", "2x2"}).options;
  Parallelism h = resolve_parallelism(hsdp, launched(4));
  EXPECT_EQ(h.mesh_shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(h.dp_size(), 4);
  EXPECT_THAT(h.describe(), HasSubstr("2 replicas, each sharded over 2 ranks"));

  // Tensor parallelism: one data-parallel copy over the whole mesh.
  Parallelism t = resolve_parallelism(parse_command_line({"--mode", "tp", "--mesh", "2"}).options,
                                      launched(2));
  EXPECT_EQ(t.mesh_shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(t.mesh_names, (std::vector<std::string>{"tp"}));
  EXPECT_EQ(t.dp_size(), 1);
  EXPECT_EQ(t.dp_rank(1), 0);

  // fsdp_tp: D data-parallel groups of T adjacent ranks.
  Parallelism ft = resolve_parallelism(
      parse_command_line({"--mode", "fsdp_tp", "--mesh", "2x3"}).options, launched(6));
  EXPECT_EQ(ft.mesh_shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ft.mesh_names, (std::vector<std::string>{"dp", "tp"}));
  EXPECT_EQ(ft.dp_size(), 2);
  EXPECT_EQ(ft.dp_rank(2), 0);
  EXPECT_EQ(ft.dp_rank(3), 1);
  EXPECT_THAT(ft.describe(), HasSubstr("every layer split over 3 ranks, its pieces sharded over "
                                       "2 data-parallel ranks"));

  // A launched world of one may still train without a process group.
  EXPECT_EQ(resolve_parallelism(parse_command_line({"--mode", "none"}).options, launched(1)).mode,
            plan::ParallelMode::kNone);
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

  // fully_shard's flags; the defaults are the fast path: fusion and
  // prefetch on, reshard after forward, fp32 everywhere.
  const TrainOptions defaults = parse_command_line({}).options;
  EXPECT_TRUE(defaults.comm_fusion);
  EXPECT_TRUE(defaults.prefetch);
  EXPECT_EQ(defaults.reshard_after_forward, std::nullopt);  // fully_shard's default
  EXPECT_EQ(defaults.param_dtype, plan::Dtype::kFloat32);
  EXPECT_EQ(defaults.reduce_dtype, std::nullopt);
  EXPECT_EQ(defaults.activation_checkpointing, "none");
  EXPECT_EQ(parse_command_line({"--activation-checkpointing", "blocks"})
                .options.activation_checkpointing,
            "blocks");
  EXPECT_TRUE(defaults.fully_shard_flags.empty());
  const TrainOptions perf =
      parse_command_line({"--no-comm-fusion", "--no-prefetch", "--reshard-after-forward", "2",
                          "--param-dtype", "bf16", "--reduce-dtype", "fp32", "--trace", "t.json"})
          .options;
  EXPECT_FALSE(perf.comm_fusion);
  EXPECT_FALSE(perf.prefetch);
  EXPECT_EQ(perf.reshard_after_forward, ReshardAfterForward(int64_t{2}));
  EXPECT_EQ(perf.param_dtype, plan::Dtype::kBFloat16);
  EXPECT_EQ(perf.reduce_dtype, plan::Dtype::kFloat32);
  EXPECT_EQ(perf.trace, "t.json");
  EXPECT_EQ(parse_command_line({"--reshard-after-forward", "false"}).options.reshard_after_forward,
            ReshardAfterForward(false));
  EXPECT_EQ(parse_command_line({"--reshard-after-forward", "true"}).options.reshard_after_forward,
            ReshardAfterForward(true));
  // The last of a repeated flag wins.
  EXPECT_EQ(parse_command_line({"--steps", "3", "--steps", "9"}).options.steps, 9);
  EXPECT_TRUE(parse_command_line({"--no-comm-fusion", "--comm-fusion"}).options.comm_fusion);
}

// The default run is the fast path: parallelize gets fusion and prefetch
// from options the user did not have to give.
TEST(Flags, DefaultsSelectCommFusionAndPrefetch) {
  const TrainOptions defaults = parse_command_line({}).options;
  EXPECT_TRUE(defaults.comm_fusion);
  EXPECT_TRUE(defaults.prefetch);
  const std::string header = header_text(
      defaults, resolve_parallelism(defaults, launched(2)),
      Corpus{at::arange(100, at::kLong), 256, "tiny"}, 1000);
  EXPECT_THAT(header, HasSubstr("comm fusion on, prefetch on"));
  EXPECT_THAT(parse_command_line({"--help"}).help_text,
              AllOf(HasSubstr("(default: on)"), HasSubstr("--no-comm-fusion takes the "
                                                          "per-parameter path")));
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
      {{"--threads", "0"}, "--threads must be a positive integer at most 1024, got '0'"},
      {{"--seed", "-1"}, "--seed must be a non-negative integer below 2^64, got '-1'"},
      {{"--vocab", "70000"},
       "--vocab must be a positive integer at most 65536 (uint16 tokens), got '70000'"},
      {{"--threads", "2000"}, "--threads must be a positive integer at most 1024, got '2000'"},
      {{"--steps", "0x10"}, "--steps must be a positive integer, got '0x10'"},
      {{"--steps", "99999999999999999999"}, "got '99999999999999999999'"},
      {{"--mode", "zero3"}, "--mode must be one of fsdp, hsdp, ddp, tp, fsdp_tp, none, got 'zero3'"},
      {{"--mesh", "2x"},
       "--mesh must be N, RxS (R replicas x S shards) or, under --pp, DxPxT or RxSxP with "
       "positive integers (each at most 1048576), e.g. 4, 2x2 or 2x2x2, got '2x'"},
      // A product that wraps around 2^64 to the world size is no mesh.
      {{"--mesh", "4611686018427387905x4x1"}, "got '4611686018427387905x4x1'"},
      {{"--mesh", "1048577"}, "got '1048577'"},
      {{"--mesh", "0"}, "got '0'"},
      {{"--mesh", "2x2x1x1"}, "got '2x2x1x1'"},
      {{"--log-json", ""}, "--log-json must name a file, got ''"},
      {{"--trace", ""}, "--trace must name a file, got ''"},
      {{"--reshard-after-forward", "yes"},
       "--reshard-after-forward must be true, false or a positive number of ranks, got 'yes'"},
      {{"--reshard-after-forward", "0"}, "got '0'"},
      {{"--param-dtype", "fp8"}, "--param-dtype must be one of bf16, fp32, got 'fp8'"},
      // Offered once, it started and then failed in the first forward.
      {{"--param-dtype", "fp16"},
       "--param-dtype fp16 is not supported: libtorch's CPU kernels have no fp16 matmul, "
       "LayerNorm"},
      {{"--reduce-dtype", "int8"}, "--reduce-dtype must be one of bf16, fp16, fp32, got 'int8'"},
      {{"--activation-checkpointing", "all"},
       "--activation-checkpointing must be one of none, blocks, got 'all'"},
      {{"--bogus"}, "unknown flag '--bogus'; see hp-train --help"},
      {{"--step", "10"}, "unknown flag '--step' (did you mean --steps?)"},
      {{"--lr=1e-3", "--layer=2"}, "unknown flag '--layer' (did you mean --layers?)"},
      {{"--comm-fuse"}, "did you mean --comm-fusion?"},
      {{"stray"}, "unexpected argument 'stray'"},
  };
  for (const auto& [args, expected] : cases) {
    SCOPED_TRACE(args[0]);
    EXPECT_THAT(check(args, launched(2)), HasSubstr(expected));
  }
}

TEST(Flags, CombinationsAreCheckedAgainstTheWorld) {
  EXPECT_THAT(
      check({"--batch", "6"}, launched(4)),
      HasSubstr("--batch 6 (the global batch) must be divisible by the data-parallel size 4"));
  EXPECT_THAT(check({"--mode", "ddp", "--batch", "3"}, launched(2)),
              HasSubstr("data-parallel size 2 (ddp on 2 ranks)"));
  EXPECT_THAT(check({"--heads", "3", "--d", "32"}, kAlone),
              HasSubstr("--heads 3 must divide --d 32"));
  EXPECT_THAT(check({"--seq", "100", "--ctx", "64"}, kAlone),
              HasSubstr("--seq 100 must be at most --ctx 64"));
  EXPECT_THAT(
      check({"--vocab", "300"}, kAlone),
      HasSubstr("--vocab 300 does not fit the default corpus (fortunes as bytes: vocab 256)"));
  EXPECT_EQ(check({"--vocab", "256"}, kAlone), "");
  EXPECT_THAT(check({"--data-file", "t.bin"}, kAlone),
              HasSubstr("--data-file t.bin needs --vocab V"));
  EXPECT_THAT(check({"--mode", "fsdp", "--mesh", "2x2"}, launched(4)),
              HasSubstr("--mode fsdp needs a 1-D mesh N, got --mesh 2x2"));
  EXPECT_THAT(check({"--mode", "tp", "--mesh", "3", "--heads", "4"}, launched(3)),
              HasSubstr("--heads 4 must be divisible by the tensor-parallel size 3"));
  // Under tensor parallelism fully_shard's flags are carried by units over a
  // data-parallel dim of one rank.
  EXPECT_EQ(check({"--mode", "tp", "--mesh", "2", "--no-comm-fusion"}, launched(2)), "");
  EXPECT_EQ(check({"--mode", "fsdp_tp", "--mesh", "2x2", "--batch", "6"}, launched(4)), "");
  EXPECT_THAT(check({"--mode", "fsdp_tp", "--mesh", "2x2", "--batch", "3"}, launched(4)),
              HasSubstr("--batch 3 (the global batch) must be divisible by the data-parallel "
                        "size 2"));
  EXPECT_THAT(check({"--mode", "fsdp_tp"}, launched(4)),
              HasSubstr("--mode fsdp_tp needs --mesh DxT"));
  EXPECT_THAT(check({"--mode", "fsdp_tp", "--mesh", "2x2", "--reshard-after-forward", "4"},
                    launched(4)),
              HasSubstr("--reshard-after-forward 4 must divide the shard group size 2 of "
                        "fsdp_tp"));
  EXPECT_EQ(check({"--mode", "tp", "--mesh", "2", "--batch", "3"}, launched(2)), "");
  EXPECT_THAT(check({"--mode", "ddp", "--mesh", "2x1"}, launched(2)),
              HasSubstr("--mode ddp needs a 1-D mesh N, got --mesh 2x1"));
  EXPECT_THAT(
      check({"--mode", "hsdp"}, launched(4)),
      HasSubstr("--mode hsdp needs --mesh RxS (replicas x shards, R*S = the world size 4)"));
  EXPECT_THAT(check({"--mode", "hsdp", "--mesh", "4"}, launched(4)),
              HasSubstr("--mode hsdp needs a 2-D mesh RxS (replicas x shards), got --mesh 4"));
  EXPECT_THAT(check({"--mesh", "3"}, launched(2)),
              HasSubstr("--mesh 3 holds 3 ranks, but the world has 2 (WORLD_SIZE)"));
  EXPECT_THAT(check({"--mode", "hsdp", "--mesh", "2x2"}, launched(2)),
              HasSubstr("--mesh 2x2 holds 4 ranks, but the world has 2"));
  EXPECT_THAT(check({"--mode", "none"}, launched(2)),
              HasSubstr("--mode none trains in one process, but WORLD_SIZE is 2"));
  EXPECT_THAT(check({"--mode", "none", "--mesh", "2"}, kAlone),
              HasSubstr("--mesh 2 does not apply to --mode none"));
  EXPECT_THAT(check({"--mode", "fsdp"}, kAlone),
              HasSubstr("--mode fsdp needs one process per rank started by a launcher"));
  // fully_shard's flags need fully_shard.
  for (const Args& args : {Args{"--comm-fusion"}, Args{"--no-comm-fusion"}, Args{"--no-prefetch"},
                           Args{"--reshard-after-forward", "false"},
                           Args{"--param-dtype", "bf16"}, Args{"--reduce-dtype", "fp32"}}) {
    EXPECT_THAT(check(args, kAlone),
                HasSubstr(args[0] + " configures fully_shard and does not apply "
                                    "to --mode none"));
  }
  EXPECT_EQ(check({"--param-dtype", "fp32"}, kAlone), "");
  EXPECT_THAT(
      check({"--reshard-after-forward", "3"}, launched(2)),
      HasSubstr("--reshard-after-forward 3 must divide the shard group size 2 of fsdp on mesh "
                "[2]"));
  EXPECT_THAT(
      check({"--mode", "hsdp", "--mesh", "2x2", "--reshard-after-forward", "4"}, launched(4)),
      HasSubstr("--reshard-after-forward 4 must divide the shard group size 2 of hsdp"));
  EXPECT_EQ(check({"--reshard-after-forward", "2"}, launched(4)), "");
  EXPECT_EQ(check({"--reduce-dtype", "fp16"}, launched(2)), "");  // a sum: works in fp16
  EXPECT_THAT(check({"--resume", "auto"}, launched(2)),
              HasSubstr("--resume auto needs --save-dir DIR"));
  EXPECT_EQ(check({"--resume", "auto", "--save-dir", "ckpt"}, launched(2)), "");
}

// --pp P --mode hsdp: --mesh RxSxP, each stage sharded over S ranks and
// replicated R times; its data-parallel size R x S is fsdp's D.
TEST(Flags, PipelineHsdpTakesAReplicasShardsPipelineMesh) {
  const Args pp = {"--pp", "2", "--mode", "hsdp", "--layers", "2", "--batch", "8",
                   "--microbatches", "2"};
  auto concat = [](Args a, const Args& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const Parallelism h = resolve_parallelism(
      parse_command_line(concat(pp, {"--mesh", "2x2x2"})).options, launched(8));
  EXPECT_EQ(h.mode, plan::ParallelMode::kHSDP);
  EXPECT_EQ(h.mesh_shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(h.replicate_size(), 2);
  EXPECT_EQ(h.shard_size(), 2);
  EXPECT_EQ(h.dp_size(), 4);
  EXPECT_EQ(check(concat(pp, {"--mesh", "2x2x2"}), launched(8)), "");
  EXPECT_THAT(check(pp, launched(4)),
              HasSubstr("--mode hsdp with --pp 2 needs --mesh RxSxP (replicas x shards x "
                        "pipeline ranks, P = 2, product 4)"));
  EXPECT_THAT(check(concat(pp, {"--mesh", "2x2"}), launched(4)),
              HasSubstr("--mesh 2x2 with --pp 2 --mode hsdp: the mesh is R x S x P (replicas x "
                        "shards x pipeline ranks), three dims, but it has 2"));
  EXPECT_EQ(check(concat(pp, {"--mesh", "1x2x2"}), launched(4)), "");
  EXPECT_THAT(check(concat(pp, {"--mesh", "2x2x1"}), launched(4)),
              HasSubstr("--mesh 2x2x1 with --pp 2 --mode hsdp: the mesh is R x S x P with P the "
                        "pipeline ranks, so its last dim must be --pp 2, got 1"));
  EXPECT_THAT(check(concat(pp, {"--mesh", "2x2x2"}), launched(4)),
              HasSubstr("--mesh 2x2x2 with --pp 2 --mode hsdp holds 8 ranks, but the world has "
                        "4 (WORLD_SIZE); R x S x P must equal the world size"));
  EXPECT_THAT(check(concat(pp, {"--mesh", "2x2x2", "--batch", "6"}), launched(8)),
              HasSubstr("--batch 6 (the global batch) must be divisible by the data-parallel "
                        "size 4"));
  EXPECT_THAT(check(concat(pp, {"--mesh", "1x2x2", "--no-prefetch"}), launched(4)),
              HasSubstr("--no-prefetch with --pp 2 --mode hsdp"));
}

// --pp P: fully_shard's flags apply where the stages are units (fsdp,
// hsdp, fsdp_tp; tp given them: units over one data-parallel rank; ddp
// given them: units over the replicas and a shard of one rank).
TEST(Flags, PipelineTakesMixedPrecisionWhereItsStagesAreUnits) {
  const Args plain = {"--pp", "2", "--layers", "2", "--batch", "8", "--microbatches", "2"};
  auto concat = [](Args a, const Args& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const Args pp = concat(plain, {"--param-dtype", "bf16", "--reduce-dtype", "fp32"});
  // The layout of `base` and then `mode` on 4 ranks.
  auto layout = [&](const Args& base, const Args& mode) {
    return resolve_parallelism(parse_command_line(concat(base, mode)).options, launched(4));
  };
  const Args tp_mode = {"--mode", "tp", "--mesh", "2x2"};
  const Parallelism tp = layout(pp, tp_mode);
  EXPECT_TRUE(tp.tp_units);
  EXPECT_EQ(tp.param_dtype, plan::Dtype::kBFloat16);
  EXPECT_EQ(tp.effective_reduce_dtype(), plan::Dtype::kFloat32);
  EXPECT_FALSE(layout(plain, tp_mode).tp_units);
  EXPECT_EQ(check(concat(pp, tp_mode), launched(4)), "");
  EXPECT_EQ(check(concat(pp, {"--mode", "fsdp_tp", "--mesh", "2x2x2"}), launched(8)), "");
  EXPECT_EQ(check(concat(pp, {"--mode", "fsdp", "--dry-run"}), launched(4)), "");
  const Parallelism ddp = layout(pp, {"--mode", "ddp"});
  EXPECT_TRUE(ddp.ddp_stage_units);
  EXPECT_EQ(ddp.mesh_shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(ddp.param_dtype, plan::Dtype::kBFloat16);
  EXPECT_EQ(ddp.effective_reduce_dtype(), plan::Dtype::kFloat32);
  EXPECT_FALSE(layout(plain, {"--mode", "ddp"}).ddp_stage_units);
  EXPECT_EQ(check(concat(pp, {"--mode", "ddp"}), launched(4)), "");
  EXPECT_EQ(check(concat(pp, {"--mode", "ddp", "--dry-run"}), launched(4)), "");
  EXPECT_THAT(check(concat(pp, {"--mode", "ddp", "--no-prefetch"}), launched(4)),
              HasSubstr("--no-prefetch with --pp 2 --mode ddp: the pipeline gathers each stage "
                        "once per step"));
  EXPECT_THAT(check(pp, launched(2)),
              HasSubstr("--reduce-dtype --param-dtype with --pp 2 --mode none: the stages are "
                        "not fully_shard units; leave them out, or add --mode fsdp (on 2 ranks"));
}

// The batch is cut into micro-batches per data-parallel rank: the
// message names them as the mode has them (replicas of the pipeline under
// ddp, data-parallel ranks of sharded stages under fsdp).
TEST(Flags, PipelineBatchNamesWhatItIsCutInto) {
  const Args pp = {"--pp", "2", "--layers", "2", "--batch", "8", "--microbatches", "8"};
  auto with = [&](const char* mode) {
    Args a = pp;
    a.insert(a.end(), {"--mode", mode});
    return a;
  };
  EXPECT_THAT(check(with("ddp"), launched(4)),
              HasSubstr("--batch 8 must be a multiple of the 8 micro-batches of a pipeline step "
                        "(--microbatches) times the 2 replicas"));
  EXPECT_THAT(check(with("fsdp"), launched(4)),
              HasSubstr("(--microbatches) times the 2 data-parallel ranks"));
  EXPECT_EQ(check(pp, launched(2)), "");
}

TEST(Flags, CountsAgreeWithTheirNouns) {
  const TrainOptions hsdp = parse_command_line({"--mode", "hsdp", "--mesh", "1x2"}).options;
  EXPECT_THAT(resolve_parallelism(hsdp, launched(2)).describe(),
              HasSubstr("1 replica, each sharded over 2 ranks"));
  EXPECT_THAT(check({"--mesh", "1"}, launched(2)), HasSubstr("--mesh 1 holds 1 rank, but"));
  TrainOptions one = parse_command_line({"--layers", "1", "--heads", "1", "--steps", "1",
                                         "--batch", "1"}).options;
  const std::string header = header_text(one, resolve_parallelism(one, kAlone),
                                         Corpus{at::arange(100, at::kLong), 256, "tiny"}, 1000);
  EXPECT_THAT(header, HasSubstr("GPT 1 layer, d 128, 1 head,"));
  EXPECT_THAT(header, HasSubstr("(1 sample per rank), 1 step\n"));
  EXPECT_THAT(header, HasSubstr("; 1 thread per rank"));
  EXPECT_THAT(summary_line(5.5, 2.25, 1, 1, 10), HasSubstr("(first -> last of 1 step)"));
}

TEST(Flags, HelpSaysWhatTheValuesMean) {
  const std::string help = parse_command_line({"--help"}).help_text;
  EXPECT_THAT(help, HasSubstr("RxS = R replicas (data-parallel copies) x S shards"));
  EXPECT_THAT(help, HasSubstr("step (0-based), loss, step_time_s, tokens_per_s, peak_bytes; "
                              "FILE's folder is created if missing"));
  EXPECT_THAT(help, HasSubstr("--param-dtype bf16|fp32 "));
}

TEST(OutputFile, UnwritablePathSaysWhy) {
  launcher::testing::TempDir dir;
  // A folder in place of the file: open(2) fails with EISDIR.
  EXPECT_THAT([&] { open_output_file("--log-json", dir.path()); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("--log-json '" + dir.path() +
                            "' cannot be opened for writing: Is a directory")));
}

// The steps a --log-json file holds, in order.
std::vector<int64_t> logged_steps(const std::string& path) {
  std::vector<int64_t> steps;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const std::string key = "{\"step\":";
    EXPECT_EQ(line.rfind(key, 0), 0u) << line;
    steps.push_back(std::stoll(line.substr(key.size())));
  }
  return steps;
}

TEST(StepLog, AResumedRunContinuesTheLogFromItsFirstStep) {
  launcher::testing::TempDir dir;
  const std::string path = dir.file("log.jsonl");
  auto record = [](int64_t step) {
    StepRecord r;
    r.step = step;
    r.loss = 5.0 - 0.1 * static_cast<double>(step);
    return r;
  };
  {
    StepLog log(path, 0);
    for (int64_t s = 0; s < 5; ++s) log.write(record(s));
  }
  {
    // A kill tore the next line.
    std::ofstream torn(path, std::ios::app);
    torn << "{\"step\": 5, \"lo";
  }
  // The checkpoint was at step 3: steps 3 and 4 are run again.
  {
    StepLog log(path, 3);
    EXPECT_EQ(logged_steps(path), (std::vector<int64_t>{0, 1, 2}));
    for (int64_t s = 3; s < 7; ++s) log.write(record(s));
  }
  EXPECT_EQ(logged_steps(path), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  // Resumed again, past a torn line: everything before it stays.
  {
    std::ofstream torn(path, std::ios::app);
    torn << "{\"ste";
  }
  { StepLog log(path, 9); }
  EXPECT_EQ(logged_steps(path), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6}));
  // A run from step 0 starts a new log.
  { StepLog log(path, 0); }
  EXPECT_EQ(logged_steps(path), std::vector<int64_t>{});
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
}

TEST(Trace, SetOriginMovesTheZeroToAWallClockInstant) {
  // One second ago on the wall clock: now_us() reads about 1 s. The bound is
  // the time between the two clock readings in set_origin and now_us here,
  // far below 0.5 s on any machine that runs the suite.
  const int64_t origin = trace::unix_now_us() - 1000000;
  trace::set_origin(origin);
  const int64_t now = trace::now_us();
  EXPECT_GE(now, 1000000);
  EXPECT_LT(now, 1500000);
  launcher::testing::TempDir dir;
  trace::enable(0, "rank 0");
  { trace::Span span("step 0", "step", "step"); }
  trace::disable();
  trace::write(dir.file("t.json"));
  std::ifstream in(dir.file("t.json"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_THAT(text, HasSubstr("\"otherData\":{\"origin_unix_us\":" + std::to_string(origin) + "}"));
}

TEST(Flags, CorpusMustHoldOneWindow) {
  TrainOptions o;
  o.seq = 8;
  Corpus corpus{at::arange(9, at::kLong), 256, "tiny.bin: 9 uint16 tokens"};
  EXPECT_THAT([&] { validate_corpus(o, corpus); },
              ThrowsMessage<ArgumentError>(HasSubstr(
                  "--seq 8 needs a corpus of at least seq + 2 = 10 tokens, but tiny.bin: 9 "
                  "uint16 tokens has 9")));
  corpus.tokens = at::arange(10, at::kLong);
  validate_corpus(o, corpus);
}

TEST(Progress, LineShowsStepLossSpeedAndEta) {
  ProgressMeter meter(300, 1000, /*window=*/2);
  meter.record(5.0);  // a slow first step leaves the window
  for (int i = 1; i < 120; ++i) meter.record(0.25);
  EXPECT_EQ(meter.line(2.34123),
            "step 120/300 | loss 2.3412 | 4.0k tok/s | 0.25 s/step | ETA 0:45");
  ProgressMeter short_run(5, 10);
  short_run.record(0.5);
  EXPECT_EQ(short_run.line(5.5), "step 1/5 | loss 5.5000 | 20 tok/s | 0.50 s/step | ETA 0:02");
}

// On a GPU the line adds the MFU of the window's pace and the step's CUDA
// peaks: 2e12 FLOPs a step in 0.25 s against 4e13 FLOP/s of peak is 20%.
TEST(Progress, GpuLineShowsMfuAndCudaPeaks) {
  ProgressMeter meter(300, 1000, /*window=*/2);
  EXPECT_FALSE(meter.mfu().has_value()) << "no basis, no step";
  meter.set_mfu_basis(/*flops_per_step=*/2e12, /*peak_flops=*/4e13);
  EXPECT_FALSE(meter.mfu().has_value()) << "no step yet";
  for (int i = 0; i < 120; ++i) meter.record(0.25);
  ASSERT_TRUE(meter.mfu().has_value());
  EXPECT_DOUBLE_EQ(*meter.mfu(), 0.2);
  EXPECT_EQ(meter.line(2.34123, std::make_pair(int64_t{3} << 30, int64_t{4} << 30)),
            "step 120/300 | loss 2.3412 | 4.0k tok/s | MFU 20.0% | 0.25 s/step | GPU peak "
            "3.00 GiB alloc / 4.00 GiB reserved | ETA 0:45");
  // A GPU's short steps keep their milliseconds.
  ProgressMeter fast(10, 1000);
  fast.record(0.0123);
  EXPECT_THAT(fast.line(1.0), HasSubstr("| 0.012 s/step |"));
}

// 6 (N - E) + 12 L d T, checked on numbers done by hand, and N - E of our
// GPT against its matmul weights counted from its shape: per block
// 12 d^2 + 13 d (attention's qkv and projection, the MLP's two, their
// biases, two LayerNorms), the final LayerNorm's 2 d, the untied head's V d.
TEST(ModelFlops, SixPerMatmulWeightPlusAttention) {
  EXPECT_DOUBLE_EQ(training_flops_per_token({1000, 200, 2, 8, 4}), 6.0 * 800 + 12.0 * 2 * 8 * 4);
  EXPECT_THAT([] { training_flops_per_token({100, 200, 1, 1, 1}); },
              ThrowsMessage<ArgumentError>(HasSubstr("embedding parameters (200)")));
  TrainOptions o;
  o.layers = 3;
  o.d = 32;
  o.heads = 4;
  o.ctx = 16;
  const TrainModel model = TrainModel::build(o, /*vocab_size=*/256, at::kMeta);
  int64_t n = 0;
  for (const auto& p : model.module().parameters()) n += p.numel();
  const int64_t d = 32, v = 256, l = 3;
  EXPECT_EQ(n - model.embedding_parameter_count(), l * (12 * d * d + 13 * d) + 2 * d + v * d);
}

TEST(ModelFlops, Bf16PeakOfKnownCards) {
  EXPECT_EQ(bf16_peak_flops("NVIDIA H100 80GB HBM3"), 989.4e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA H100 PCIe"), 756e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA H200"), 989.4e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA L40S"), 362.05e12);
  EXPECT_EQ(bf16_peak_flops("NVIDIA L4"), 121e12);
  EXPECT_FALSE(bf16_peak_flops("NVIDIA GeForce RTX 4090").has_value());
}

// --device: cpu or cuda, default cuda where a GPU is visible. Asking for
// cuda without one, or for an MFU peak on the CPU, is refused naming the
// flag, before anything runs.
TEST(Flags, DeviceIsCudaOrCpuAndCudaNeedsAVisibleGpu) {
  EXPECT_EQ(parse_command_line({"--device", "cpu"}).options.device, "cpu");
  EXPECT_EQ(parse_command_line({"--device", "cuda"}).options.device, "cuda");
  EXPECT_THAT([] { parse_command_line({"--device", "tpu"}); },
              ThrowsMessage<ArgumentError>(HasSubstr("--device must be one of cuda, cpu, got 'tpu'")));
  EXPECT_THAT([] { parse_command_line({"--peak-tflops", "0"}); },
              ThrowsMessage<ArgumentError>(
                  HasSubstr("--peak-tflops must be a positive number, got '0'")));
  TrainOptions o;
  o.device = "cpu";
  o.peak_tflops = 989;
  EXPECT_THAT([&] { select_device(o, World{}); },
              ThrowsMessage<ArgumentError>(HasSubstr("--peak-tflops 989 applies to --device cuda")));
  o.peak_tflops = 0;
  EXPECT_EQ(select_device(o, World{}).type, "cpu");
  TrainOptions unset;
  EXPECT_EQ(resolve_device_type(unset), compat::cuda_available() ? "cuda" : "cpu");
  if (compat::cuda_available()) GTEST_SKIP() << "a GPU is visible: --device cuda is accepted";
  o.device = "cuda";
  EXPECT_THAT([&] { resolve_device_type(o); },
              ThrowsMessage<ArgumentError>(HasSubstr("--device cuda needs a")));
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
  EXPECT_THAT(summary_line(5.5, 2.25, 300, 151, 2040), HasSubstr("loss 5.5000 -> 2.2500"));
  EXPECT_THAT(summary_line(5.5, 2.25, 300, 151, 2040, 1.3), HasSubstr("; sampling took 1.3 s"));
  EXPECT_THAT(memory_table({1 << 20, 2 << 20}, 1000), HasSubstr("rank 1: 2.0 MiB (2097152 bytes)"));
  EXPECT_THAT(memory_table({1 << 20, 2 << 20}, 1000, {3 << 20, 5 << 20}, {4 << 20, 6 << 20}),
              AllOf(HasSubstr("and the GPU's caching allocator"),
                    HasSubstr("rank 1: 2.0 MiB (2097152 bytes); GPU 5.0 MiB allocated, 6.0 MiB "
                              "reserved")));
}

// --init-from in-process: the file of one seed's model turns another seed's
// model into it; any mismatch names the file and the tensor.
class InitFrom : public testing::Test {
 protected:
  static nn::GPTConfig config() { return test::byte_gpt_config(); }
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
  // Loading `path` raises an ArgumentError whose message matches `matcher`,
  // and copies nothing.
  template <typename Matcher>
  void expect_refused(const std::string& path, Matcher matcher) {
    nn::GPT target = model(2);
    const nn::GPT untouched = model(2);  // the same weights, never loaded into
    EXPECT_THAT([&] { load_initial_weights(*target, path); },
                ThrowsMessage<ArgumentError>(matcher));
    const auto expected = untouched->named_parameters();
    for (const auto& p : target->named_parameters()) {
      EXPECT_TRUE(test::tensors_equal(p.value(), expected[p.key()])) << p.key();
    }
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
  const std::string path = write(missing);
  expect_refused(path, AllOf(HasSubstr("--init-from '" + path + "' does not match the model"),
                             HasSubstr("missing tensor '" + all[3].first +
                                       "' (expected shape [")));

  auto extra = all;
  extra.emplace_back("h.9.mlp.c_fc.weight", at::zeros({4, 4}));
  expect_refused(write(extra),
                 HasSubstr("unexpected tensor 'h.9.mlp.c_fc.weight' of shape [4, 4]"));

  auto reshaped = all;
  for (auto& [name, tensor] : reshaped) {
    if (name == "wte.weight") tensor = at::zeros({300, 32});
  }
  expect_refused(write(reshaped),
                 HasSubstr("tensor 'wte.weight' has shape [300, 32], expected [256, 32]"));

  auto integers = all;
  integers[0].second = integers[0].second.to(at::kInt);
  expect_refused(write(integers), HasSubstr("tensor '" + all[0].first +
                                            "' has dtype Int, expected a floating dtype"));

  expect_refused(dir_.file("absent.safetensors"),
                 AllOf(HasSubstr("--init-from: "), HasSubstr("absent.safetensors")));
}

// The names are checked from the header before any data is read: a file of
// another model is refused even when its data would not fit in memory (one
// sparse tensor of 1 TiB here, which reading first failed to allocate).
TEST_F(InitFrom, NamesAreCheckedBeforeAnyDataIsRead) {
  const std::string path = dir_.file("huge.safetensors");
  constexpr uint64_t kBytes = uint64_t{1} << 40;
  const std::string header = R"({"huge":{"dtype":"U8","shape":[1099511627776],)"
                             R"("data_offsets":[0,1099511627776]}})";
  {
    std::ofstream out(path, std::ios::binary);
    const uint64_t length = header.size();
    out.write(reinterpret_cast<const char*>(&length), 8);
    out << header;
  }
  std::error_code ec;
  std::filesystem::resize_file(path, 8 + header.size() + kBytes, ec);
  if (ec) GTEST_SKIP() << "this file system holds no sparse file of 1 TiB: " << ec.message();
  expect_refused(path, AllOf(HasSubstr("--init-from '" + path + "' does not match the model"),
                             HasSubstr("the file holds 1 tensor and no GPT-2 embeddings")));
}

// A file of another model: a few problems listed, the rest counted, and the
// shape the file holds named, instead of a line per tensor.
TEST_F(InitFrom, AnotherModelsFileIsSummarised) {
  nn::GPTConfig big = config();
  big.n_layer = 3;
  big.n_embd = 48;
  big.n_head = 4;
  torch::manual_seed(1);
  nn::GPT other(big);
  const std::string path = write(weights(other));
  nn::GPT target = model(2);
  std::string message;
  try {
    load_initial_weights(*target, path);
  } catch (const ArgumentError& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr("does not match the model: "));
  EXPECT_THAT(message, HasSubstr("problems, the first 5"));
  EXPECT_THAT(message, HasSubstr("... and "));
  EXPECT_THAT(message, HasSubstr("the file looks like a GPT of 3 layers, d 48, ctx 16, vocab 256 "
                                 "(--layers 3 --d 48 --ctx 16)"));
  // The heading, five problems, the count of the rest, the file's shape.
  EXPECT_EQ(std::count(message.begin(), message.end(), '\n'), 7) << message;
}

}  // namespace
}  // namespace hp::train
