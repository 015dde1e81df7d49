// hp-train end to end: the real binary, one process or real ranks under
// hprun, on a tiny GPT (2 layers, d 32, seq 16, global batch 4).
//
// What the logged losses can be held to, and why:
//
// - Step 0's loss is measured before any update: the initial weights on the
//   first global batch of kTokens = 4 x 16 tokens, each rank taking its
//   slice. It is compared with first_loss, the same arithmetic done here:
//   each slice through the same model (same weights, one thread, as
//   hp-train runs), its fp32 mean loss, the rank means averaged in double in
//   rank order. What may still differ is the order of those sums: each fp32
//   mean of positive token losses is within summation_bound, 2 n u times
//   the mean (u = 2^-24, n <= kTokens), of its exact value, so the two are
//   within reordered_sum_bound(L, kTokens, Float), about 1.5e-5 L, plus the
//   double mean's rounding (first_loss_bound). Wrong weights (a bad gather)
//   or a wrong slice miss that by orders of magnitude.
//   The modes are not compared with each other at step 0: a pass over 2
//   samples and one over 4 need not give the same logits for the same rows
//   (the GEMM kernel may block or dispatch by size; it does here, by ulps),
//   and the loss is not bounded through such differences without an error
//   analysis of the whole forward.
// - Later steps have no bound that the logs can support: the modes'
//   gradients differ by such roundings, AdamW divides each by sqrt(v), which
//   for a gradient near zero turns a few ulps into up to ~lr, and every later
//   loss depends on all of the weights. AdamW's elementwise bound (each step
//   from the same parameters, one process against fully_shard) is checked
//   where the weights are visible (tests/fsdp/gpt_training_test.cpp). Here
//   the later steps are held to what holds exactly: on 2 ranks every
//   cross-rank sum has two terms, which any order adds alike, and each rank
//   does the same local arithmetic in fsdp (fused or per parameter) and ddp,
//   so without gradient clipping (its norm is summed over differently laid
//   out shards) these give the same losses bit for bit at every step; every
//   mode lowers the loss; the same flags twice give the same bits.
// - bf16 (parameters and compute; fp32 reduction) is compared only with
//   bf16: step 0 with the model cast to bf16 here (the same arithmetic: the
//   units gather the weights rounded to bf16 and hand fp32 logits to the
//   loss), under the same bound, and later steps fused against per
//   parameter, bit for bit, as above. Its distance from the fp32 curve is not
//   bounded: that is the model's sensitivity to 8-bit weights and
//   activations, not a rounding of the same sum.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "hp/util/trace.h"
#include "hp/util/torch_compat.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/corpus.h"
#include "tests/hp_train/hp_train_runner.h"
#include "tests/launcher/process_runner.h"
#include "tests/nn/gpt_sensitivity.h"
#include "tests/support/model_configs.h"
#include "tests/support/rounding_bounds.h"

namespace hp::train {
namespace {

using launcher::testing::ProcessResult;
using launcher::testing::run_process;
using launcher::testing::TempDir;
using test_run::Args;

const Args kTiny = {"--layers", "2",  "--d",     "32", "--heads",         "2",
                    "--ctx",    "16", "--seq",   "16", "--batch",         "4",
                    "--steps",  "5",  "--lr",    "1e-2", "--sample-tokens", "16",
                    "--log-every", "1"};

using test_run::concat;
using test_run::describe;
using test_run::hp_train;

using testing::HasSubstr;
using testing::Not;

struct Step {
  int64_t step;
  double loss;
};

// Reads --log-json's lines, checking each has every field.
std::vector<Step> read_log(const std::string& path) {
  std::vector<Step> steps;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    for (const char* field : {"step", "loss", "step_time_s", "tokens_per_s", "peak_bytes"}) {
      EXPECT_TRUE(j.contains(field)) << field << " missing in " << line;
    }
    EXPECT_GT(j.value("step_time_s", 0.0), 0) << line;
    EXPECT_GT(j.value("tokens_per_s", 0.0), 0) << line;
    EXPECT_GT(j.value("peak_bytes", int64_t{0}), 0) << line;
    steps.push_back({j.at("step").get<int64_t>(), j.at("loss").get<double>()});
  }
  return steps;
}

// Runs and returns the per-step losses (failing the test when the run does).
// printed: where to put the run's standard output, if anywhere.
std::vector<double> losses(int ranks, const Args& args, const TempDir& dir,
                           const std::string& name, std::string* printed = nullptr) {
  const std::string log = dir.file(name + ".jsonl");
  ProcessResult r = hp_train(ranks, concat(args, {"--log-json", log}));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << name << ": " << describe(r);
  if (printed) *printed = r.out;
  std::vector<double> out;
  for (const Step& s : read_log(log)) out.push_back(s.loss);
  return out;
}

// Every parity run leaves the gradient unclipped: the clip factor comes from
// a norm summed over each mode's own shard layout, and the bitwise checks
// below hold for arithmetic done alike.
const Args kNoClip = {"--grad-clip", "0"};
constexpr int64_t kTokens = 4 * 16;  // kTiny's global batch x seq
using test_run::kDefaultSeed;

// The model hp-train builds from --seed: the same draws in the same order.
nn::GPT tiny_model(uint64_t seed) {
  torch::manual_seed(seed);
  return nn::GPT(test::byte_gpt_config());
}

// kTiny's first global batch, or rank `rank`'s slice of it on `dp_size`.
Batch first_batch(int64_t rank = 0, int64_t dp_size = 1) {
  static const at::Tensor tokens = load_fortunes().tokens;
  return batch_for_step(tokens, 0, 4, 16, rank, dp_size);
}

// The step-0 loss hp-train logs on `dp_size` ranks, computed here the same
// way: each rank's slice of the first batch through `model` (fp32 logits to
// the loss), the ranks' fp32 means averaged in double in rank order. One
// thread, as hp-train runs by default.
double first_loss(nn::GPT& model, int64_t dp_size) {
  torch::NoGradGuard no_grad;
  at::set_num_threads(1);
  double sum = 0;
  for (int64_t r = 0; r < dp_size; ++r) {
    const Batch batch = first_batch(r, dp_size);
    sum += nn::cross_entropy(model(batch.inputs).to(torch::kFloat), batch.targets)
               .item<double>();
  }
  return sum / static_cast<double>(dp_size);
}

// How far hp-train's step-0 loss on `dp_size` ranks can be from first_loss,
// `loss` (see the top of the file): the same positive fp32 token losses
// averaged in another order, then dp_size rank means averaged in double.
double first_loss_bound(double loss, int64_t dp_size) {
  return test::reordered_sum_bound(loss, kTokens, at::kFloat) +
         test::reordered_sum_bound(loss, dp_size, at::kDouble);
}

// The run a new user starts, shrunk: the defaults (fusion and prefetch on)
// train, print what they do, sample with the parameters gathered once, and
// trace every rank on one time base.
TEST(HpTrain, TinyRunOnTwoRanksLogsEveryStep) {
  TempDir dir;
  const std::string log = dir.file("tiny.jsonl");
  const std::string trace = dir.file("trace.json");
  const int64_t launched_us = trace::unix_now_us();
  ProcessResult r = hp_train(2, concat(kTiny, {"--log-json", log, "--trace", trace}));
  const int64_t ended_us = trace::unix_now_us();
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);

  std::vector<Step> steps = read_log(log);
  ASSERT_EQ(steps.size(), 5u) << describe(r);
  for (size_t i = 0; i < steps.size(); ++i) {
    EXPECT_EQ(steps[i].step, static_cast<int64_t>(i));
    EXPECT_TRUE(std::isfinite(steps[i].loss));
  }
  // Bytes start near uniform (ln 256 = 5.55) and a few steps at lr 1e-2 lower it.
  EXPECT_NEAR(steps[0].loss, std::log(256.0), 0.3);
  EXPECT_LT(steps[4].loss, steps[0].loss - 0.5);

  // What rank 0 shows: header, progress, memory of both ranks, sample, summary.
  for (const std::string& part : std::vector<std::string>{
           "[rank 0] hp-train: GPT 2 layers, d 32, 2 heads, ctx 16, vocab 256",
           "fsdp on mesh [2] ['shard']", "comm fusion on, prefetch on, reshard after forward true",
        "[rank 0] step 1/5 | loss ", "[rank 0] step 5/5 | loss ", " tok/s | ", " s/step | ETA ",
        "[rank 0]   rank 0: ", "[rank 0]   rank 1: ", "[rank 0] step log written to " + log,
        "[rank 0] sampling 16 tokens from the trained model...", "[rank 0] sample (16 tokens",
        "(first -> last of 5 steps)", "; sampling took "}) {
    EXPECT_THAT(r.out, HasSubstr(part)) << describe(r);
  }
  EXPECT_THAT(r.out, Not(HasSubstr("[rank 1] step"))) << "only rank 0 reports";

  // Sampling gathers each unit's parameters once (fused: one all-gather per
  // unit, the 2 blocks and the root), not once per token (16 x 3).
  std::smatch gathers;
  ASSERT_TRUE(std::regex_search(r.out, gathers,
                                std::regex("; [0-9.]+ s, ([0-9]+) all-gathers? to gather")))
      << describe(r);
  EXPECT_LE(std::stoi(gathers[1]), 3) << describe(r);

  // Both ranks count from rank 0's wall-clock reading, taken during the run.
  std::vector<int64_t> origins;
  for (int rank : {0, 1}) {
    const std::string path = dir.file("trace.rank" + std::to_string(rank) + ".json");
    std::ifstream in(path);
    ASSERT_TRUE(in.is_open()) << path;
    const auto document = nlohmann::json::parse(in);
    ASSERT_TRUE(document.contains("otherData")) << path;
    origins.push_back(document["otherData"].value("origin_unix_us", int64_t{0}));
  }
  EXPECT_EQ(origins[0], origins[1]);
  EXPECT_GE(origins[0], launched_us);
  EXPECT_LE(origins[0], ended_us);
}

TEST(HpTrain, ModesAgreeAndSeedsRepeat) {
  TempDir dir;
  const Args parity = concat(kTiny, kNoClip);
  const std::vector<double> single = losses(0, concat(parity, {"--mode", "none"}), dir, "none");
  ASSERT_EQ(single.size(), 5u);
  const std::vector<double> fsdp = losses(2, concat(parity, {"--mode", "fsdp"}), dir, "fsdp");
  const std::vector<double> ddp = losses(2, concat(parity, {"--mode", "ddp"}), dir, "ddp");
  const std::vector<double> hsdp =
      losses(4, concat(parity, {"--mode", "hsdp", "--mesh", "2x2"}), dir, "hsdp");

  // Step 0: the initial model on each mode's slices, as computed here.
  nn::GPT model = tiny_model(kDefaultSeed);
  const std::vector<std::tuple<std::string, std::vector<double>, int64_t>> modes = {
      {"none", single, 1}, {"fsdp on 2", fsdp, 2}, {"ddp on 2", ddp, 2},
      {"hsdp on 2x2", hsdp, 4}};
  for (const auto& [what, curve, ranks] : modes) {
    ASSERT_EQ(curve.size(), 5u) << what;
    const double expected = first_loss(model, ranks);
    EXPECT_TRUE(test::within_bound(curve[0], expected, first_loss_bound(expected, ranks)))
        << what << ", step 0";
    EXPECT_LT(curve[4], curve[0] - 0.5) << what << " trains";
  }
  // Every step: on 2 ranks fsdp and ddp do the same arithmetic.
  EXPECT_EQ(ddp, fsdp) << "ddp and fsdp on 2 ranks";

  // Same flags, same bits (with clipping too); another seed, other weights.
  EXPECT_EQ(losses(0, concat(parity, {"--mode", "none"}), dir, "none_again"), single);
  const std::vector<double> clipped = losses(2, kTiny, dir, "fsdp_a");
  EXPECT_EQ(losses(2, kTiny, dir, "fsdp_b"), clipped);
  EXPECT_NE(losses(0, concat(kTiny, {"--seed", "7"}), dir, "seed7").at(0), single.at(0));
}

// --pp: every pipeline rank holds its stages of the one-process model.
// Step 0's loss is the mean of the micro-batch losses: with --microbatches 2
// on kTiny's batch of 4 the micro-batches are the slices first_loss takes
// for 2 ranks, each through the same kernels at the same shapes, and their
// means, each halved (exact), are added in fp32: first_loss_bound for 2,
// plus that one rounding, at most 2^-24 of the loss. Without clipping every
// schedule does the same arithmetic per parameter in the same micro-batch
// order (the stages only decide where it runs), so all four schedules, on
// one or two stages per rank, give the same losses bit for bit at every step.
TEST(HpTrain, PipelineSchedulesTrainTheOneProcessModel) {
  TempDir dir;
  const Args pipeline = concat(kTiny, concat(kNoClip, {"--pp", "2", "--microbatches", "2"}));
  const std::vector<double> one_f_one_b = losses(2, pipeline, dir, "1f1b");
  ASSERT_EQ(one_f_one_b.size(), 5u);
  nn::GPT model = tiny_model(kDefaultSeed);
  const double expected = first_loss(model, 2);
  EXPECT_TRUE(test::within_bound(one_f_one_b[0], expected,
                                 first_loss_bound(expected, 2) + std::ldexp(expected, -24)))
      << "step 0";
  EXPECT_LT(one_f_one_b[4], one_f_one_b[0] - 0.5) << "trains";
  EXPECT_EQ(losses(2, concat(pipeline, {"--pp-schedule", "gpipe"}), dir, "gpipe"), one_f_one_b);

  // Four blocks: two stages per rank for the looped schedules; the traces
  // in a folder the run creates, as in the other modes.
  const Args deeper = concat(pipeline, {"--layers", "4", "--trace", dir.file("traces/pp.json")});
  const std::vector<double> plain = losses(2, deeper, dir, "1f1b_4");
  ASSERT_EQ(plain.size(), 5u);
  for (const char* schedule : {"interleaved", "zero-bubble"}) {
    EXPECT_EQ(losses(2, concat(deeper, {"--pp-schedule", schedule}), dir, schedule), plain)
        << schedule;
  }
  // Each rank's trace shows its stages' forwards, backwards and transfers.
  std::ifstream trace(dir.file("traces/pp.rank1.json"));
  const std::string text((std::istreambuf_iterator<char>(trace)), std::istreambuf_iterator<char>());
  for (const char* span : {"\"3I1\"", "\"3W1\"", "\"1F0\"", "\"1SEND_F0\"", "\"3RECV_F1\"",
                           "pipeline compute", "pipeline p2p", "pipeline wait"}) {
    EXPECT_THAT(text, HasSubstr(span));
  }
}

// Two replicas of a 2-rank pipeline (--mode ddp, 4 ranks): each replica
// trains on its half of the batch, and their gradients are averaged after
// each step. Step 0 is the mean of four 1-sample micro-batch losses, the
// slices first_loss takes for 4 ranks (each replica's two micro-batch means
// halved, exact, and added in fp32: one rounding, at most 2^-24 of its
// loss, then the replicas' averaged in double).
TEST(HpTrain, PipelineReplicasTrainTheOneProcessModel) {
  TempDir dir;
  const Args replicas =
      concat(kTiny, concat(kNoClip, {"--pp", "2", "--mode", "ddp", "--microbatches", "2"}));
  const std::vector<double> curve = losses(4, replicas, dir, "pp_ddp");
  ASSERT_EQ(curve.size(), 5u);
  nn::GPT model = tiny_model(kDefaultSeed);
  const double expected = first_loss(model, 4);
  EXPECT_TRUE(test::within_bound(curve[0], expected,
                                 first_loss_bound(expected, 4) + std::ldexp(expected, -24)))
      << "step 0";
  EXPECT_LT(curve[4], curve[0] - 0.5) << "trains";
  EXPECT_EQ(losses(4, concat(replicas, {"--mesh", "2x2"}), dir, "pp_ddp_mesh"), curve);
}

// Each stage sharded over two data-parallel ranks (dp 2 x pp 2): the same
// losses, bit for bit, as two replicas of the pipeline. Both average the
// two replicas' whole gradients, accumulated over the same micro-batches
// in the same order (a sum of two halved: exact, whichever collective);
// clipping is off, since its norm sums over shards in one and over whole
// tensors in the other. HSDP stages (--mesh RxSxP) with R x S = 2 read
// fsdp's slices and do the same: 1x2x2 shards each stage over 2 ranks with
// one replica (fsdp's reduce-scatter, nothing to all-reduce), 2x1x2 keeps
// it whole in 2 replicas whose gradients are all-reduced (two halved
// terms again): bit for bit fsdp's losses.
TEST(HpTrain, PipelineShardedStagesTrainLikeReplicas) {
  TempDir dir;
  const Args pipeline = concat(kTiny, concat(kNoClip, {"--pp", "2", "--microbatches", "2"}));
  const std::vector<double> replicas = losses(4, concat(pipeline, {"--mode", "ddp"}), dir, "ddp");
  ASSERT_EQ(replicas.size(), 5u);
  // Each stage's units gather and reduce over flat buffers by default, as
  // in the other modes, and per parameter under --no-comm-fusion: the same
  // two-term sums either way.
  std::vector<double> sharded;
  for (const bool fused : {true, false}) {
    const std::string log = dir.file(fused ? "fsdp.jsonl" : "fsdp_per_parameter.jsonl");
    Args args = concat(pipeline, {"--mode", "fsdp", "--mesh", "2x2", "--log-json", log});
    if (!fused) args.push_back("--no-comm-fusion");
    const ProcessResult r = hp_train(4, args);
    ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
    EXPECT_THAT(r.out, HasSubstr(fused ? "gathered once per step, comm fusion on)"
                                       : "gathered once per step, per-parameter collectives)"));
    std::vector<double> got;
    for (const Step& s : read_log(log)) got.push_back(s.loss);
    EXPECT_EQ(got, replicas) << (fused ? "comm fusion" : "--no-comm-fusion");
    if (fused) sharded = got;
  }
  for (const char* mesh : {"1x2x2", "2x1x2"}) {
    EXPECT_EQ(losses(4, concat(pipeline, {"--mode", "hsdp", "--mesh", mesh}), dir,
                     std::string("hsdp_") + mesh),
              sharded)
        << "--mode hsdp --mesh " << mesh;
  }
  // Zero bubble (two stages per rank, so four blocks): split backwards
  // inside the sharded stages' pipeline steps.
  const Args split = concat(pipeline, {"--layers", "4", "--pp-schedule", "zero-bubble"});
  EXPECT_EQ(losses(4, concat(split, {"--mode", "fsdp"}), dir, "fsdp_zb"),
            losses(4, concat(split, {"--mode", "ddp"}), dir, "ddp_zb"));
}

// Two stages of 2 micro-batches, bf16 compute and fp32 reduction.
Args bf16_pipeline() {
  return concat(kTiny, concat(kNoClip, {"--pp", "2", "--microbatches", "2", "--param-dtype",
                                        "bf16", "--reduce-dtype", "fp32"}));
}

// Sharded stages in mixed precision (bf16 parameters and compute, fp32
// reduction), dp 2 x pp 2: step 0 against the model cast to bf16 here, on
// the four 1-sample slices first_loss takes for 4 ranks (each micro-batch
// runs the reference's ops on the same bf16 weights; the logits go to the
// loss in fp32), within PipelineReplicasTrainTheOneProcessModel's bound;
// it trains; and hsdp's 1x2x2, the same units over the same shard group,
// gives fsdp's losses bit for bit. So do two replicas of the pipeline
// (--mode ddp) given these flags: their stages become units over the
// replicas and a shard of one rank (hsdp's 2x1x2), whose two fp32
// gradients are averaged as fsdp's reduce-scatter averages them (two
// halved terms: exact, as in PipelineShardedStagesTrainLikeReplicas).
TEST(HpTrain, PipelineShardedStagesTrainInBf16) {
  TempDir dir;
  const Args pipeline = bf16_pipeline();
  std::string printed;
  const std::vector<double> curve =
      losses(4, concat(pipeline, {"--mode", "fsdp", "--mesh", "2x2"}), dir, "fsdp_bf16", &printed);
  ASSERT_EQ(curve.size(), 5u);
  EXPECT_THAT(printed, HasSubstr("comm fusion on, bf16 compute with fp32 reduction)"));
  nn::GPT model = tiny_model(kDefaultSeed);
  model->to(torch::kBFloat16);
  const double expected = first_loss(model, 4);
  EXPECT_TRUE(test::within_bound(curve[0], expected,
                                 first_loss_bound(expected, 4) + std::ldexp(expected, -24)))
      << "step 0";
  EXPECT_LT(curve[4], curve[0] - 0.5) << "trains";
  EXPECT_EQ(losses(4, concat(pipeline, {"--mode", "hsdp", "--mesh", "1x2x2"}), dir, "hsdp_bf16"),
            curve);
  EXPECT_EQ(losses(4, concat(pipeline, {"--mode", "ddp"}), dir, "ddp_bf16", &printed), curve);
  EXPECT_THAT(printed, HasSubstr("x 2 replicas (ddp: each stage fully_shard units replicated "
                                 "over them, a shard of one rank, comm fusion on, bf16 compute "
                                 "with fp32 reduction)"));
}

// Tensor-parallel stages in mixed precision (P x T = 2x2, bf16 compute,
// fp32 reduction): --mode tp given fully_shard's flags makes each stage's
// units over a data-parallel dim of one rank, which only cast (their
// arithmetic against the TP model cast to bf16, bit for bit:
// PipelineRanks.TensorParallelStages); here the flags reach them: the mode
// line says so, it trains, and it gives the losses of --mode fsdp_tp on
// 1x2x2 (the same units) bit for bit, whose mode line names the same units.
TEST(HpTrain, PipelineTensorParallelStagesTrainInBf16) {
  TempDir dir;
  const Args pipeline = bf16_pipeline();
  const std::string units =
      "pipeline over 2 ranks x 2 tensor-parallel ranks per stage (fully_shard units over one "
      "data-parallel rank: comm fusion on, bf16 compute with fp32 reduction)";
  std::string printed;
  const std::vector<double> curve =
      losses(4, concat(pipeline, {"--mode", "tp", "--mesh", "2x2"}), dir, "tp_bf16", &printed);
  ASSERT_EQ(curve.size(), 5u);
  EXPECT_THAT(printed, HasSubstr(units));
  EXPECT_LT(curve[4], curve[0] - 0.5) << "trains";
  EXPECT_EQ(losses(4, concat(pipeline, {"--mode", "fsdp_tp", "--mesh", "1x2x2"}), dir,
                   "fsdp_tp_bf16", &printed),
            curve);
  EXPECT_THAT(printed, HasSubstr(units)) << "--mode fsdp_tp over one data-parallel rank";
}

// What the pipeline refuses, on every rank, before any collective.
TEST(HpTrain, PipelineFlagsAreCheckedBeforeAnyCollective) {
  const Args pipeline = concat(kTiny, {"--pp", "2"});
  const std::vector<std::tuple<int, Args, std::string>> cases = {
      {3, pipeline, "--pp 2 runs on exactly 2 ranks (one per pipeline rank), but WORLD_SIZE is 3"},
      {2, concat(pipeline, {"--microbatches", "1"}), "--microbatches 1"},
      {2, concat(pipeline, {"--pp-schedule", "interleaved", "--microbatches", "4"}),
       "4 stages exceed --layers 2"},
      {2, concat(pipeline, {"--batch", "6", "--microbatches", "4"}),
       "--batch 6 must be a multiple of the 4 micro-batches"},
      {2, concat(pipeline, {"--pp-split", "h.7"}), "split point 'h.7' names no block"},
      {2, concat(pipeline, {"--mode", "hsdp"}), "--mode hsdp with --pp 2 needs --mesh RxSxP"},
      {2, concat(pipeline, {"--mode", "hsdp", "--mesh", "1x2"}),
       "--mesh 1x2 with --pp 2 --mode hsdp: the mesh is R x S x P (replicas x shards x pipeline "
       "ranks), three dims, but it has 2"},
      {4, concat(pipeline, {"--mode", "fsdp_tp"}), "--mode fsdp_tp with --pp 2 needs --mesh"},
      {8, concat(pipeline, {"--mode", "fsdp_tp", "--mesh", "2x4x1"}),
       "the mesh is D x P x T with P = 2 and a product of WORLD_SIZE 8"},
      {4, concat(pipeline, {"--mode", "fsdp", "--no-prefetch"}),
       "--no-prefetch with --pp 2 --mode fsdp: the pipeline gathers each stage once per step"},
      {2, concat(pipeline, {"--param-dtype", "bf16"}),
       "--param-dtype with --pp 2 --mode none: the stages are not fully_shard units; leave it "
       "out, or add --mode fsdp (on 2 ranks each stage's units are over one data-parallel rank, "
       "which only cast)"},
      {4, concat(pipeline, {"--mode", "ddp", "--microbatches", "2", "--reshard-after-forward",
                            "false"}),
       "--reshard-after-forward with --pp 2 --mode ddp: the pipeline gathers each stage once "
       "per step"},
      {2, concat(pipeline, {"--save-async"}), "--save-async needs --save-dir DIR"},
      {3, concat(pipeline, {"--mode", "ddp"}), "--pp 2 --mode ddp runs on a multiple of 2 ranks"},
      {4, concat(pipeline, {"--mode", "ddp", "--mesh", "4x1"}), "the mesh is D x P = 2x2"},
      {4, concat(pipeline, {"--mode", "ddp", "--microbatches", "4"}),
       "--batch 4 must be a multiple of the 4 micro-batches of a pipeline step (--microbatches) "
       "times the 2 replicas"},
      {1, concat(kTiny, {"--microbatches", "4"}), "need --pp P with P > 1"},
  };
  for (const auto& [ranks, args, message] : cases) {
    const ProcessResult r = hp_train(ranks, args);
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err + r.out, HasSubstr(message));
  }
}

TEST(HpTrain, PerformanceFlagsTrainTheSameModel) {
  TempDir dir;
  const Args parity = concat(kTiny, kNoClip);
  const std::vector<double> fused = losses(2, parity, dir, "fused");
  ASSERT_EQ(fused.size(), 5u);

  // The per-parameter path, no prefetch, parameters kept after forward: on
  // 2 ranks the same arithmetic as the fused path (two-term sums), so the
  // same losses bit for bit; and one trace per rank, in a folder the run
  // creates.
  const std::string trace = dir.file("traces/step.json");
  EXPECT_EQ(losses(2,
                   concat(parity, {"--no-comm-fusion", "--no-prefetch",
                                   "--reshard-after-forward", "false", "--trace", trace}),
                   dir, "per_parameter"),
            fused)
      << "per-parameter, no prefetch, kept after forward";
  for (int rank : {0, 1}) {
    const std::string path = dir.file("traces/step.rank" + std::to_string(rank) + ".json");
    std::ifstream in(path);
    ASSERT_TRUE(in.is_open()) << path;
    const auto events = nlohmann::json::parse(in)["traceEvents"];
    bool forward = false, all_gather = false, reduce_scatter = false;
    std::set<std::string> lanes;
    for (const auto& e : events) {
      const std::string name = e.value("name", "");
      forward |= name.rfind("forward ", 0) == 0;
      all_gather |= name.rfind("all_gather", 0) == 0;
      reduce_scatter |= name.rfind("reduce_scatter", 0) == 0;
      if (name == "thread_name") lanes.insert(e["args"].value("name", ""));
      EXPECT_NE(name.rfind("issue ", 0), 0u) << "a stream's issue span on the host: " << name;
    }
    EXPECT_TRUE(forward && all_gather && reduce_scatter) << path;
    // On the CPU (Gloo) the host spans alone: GPU lanes come only from
    // device streams.
    EXPECT_TRUE(lanes.count("compute") && lanes.count("all_gather")) << path;
    for (const std::string& lane : lanes) {
      EXPECT_NE(lane.rfind("gpu ", 0), 0u) << path << ": lane '" << lane << "'";
    }
  }

  // bf16 parameters and compute, fp32 reduction, against bf16 only (see the
  // top): step 0 against the model cast to bf16 here, fp32 logits to the
  // loss; every step fused against per parameter.
  const Args bf16_flags = concat(parity, {"--param-dtype", "bf16", "--reduce-dtype", "fp32"});
  const std::vector<double> bf16 = losses(2, bf16_flags, dir, "bf16");
  ASSERT_EQ(bf16.size(), 5u);
  nn::GPT model = tiny_model(kDefaultSeed);
  model->to(torch::kBFloat16);
  const double reference = first_loss(model, 2);
  EXPECT_TRUE(test::within_bound(bf16[0], reference, first_loss_bound(reference, 2)))
      << "bf16 step 0";
  EXPECT_LT(bf16[4], bf16[0] - 0.5) << "bf16 trains";
  EXPECT_EQ(losses(2, concat(bf16_flags, {"--no-comm-fusion"}), dir, "bf16_per_parameter"), bf16)
      << "bf16, per-parameter";
}

// The tiny model's weights drawn with manual_seed(99), as a file.
std::string write_weights(const TempDir& dir, nn::GPT& model) {
  const std::string path = dir.file("init.safetensors");
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  checkpoint::write_safetensors(path, tensors);
  return path;
}

TEST(HpTrain, InitFromGivesTheFilesModelInEveryMode) {
  TempDir dir;
  nn::GPT model = tiny_model(99);
  const std::string weights = write_weights(dir, model);
  const Args args = concat(kTiny, {"--init-from", weights, "--steps", "1"});

  // The first step's loss is the file's model on batch 0 (first_loss).
  const std::vector<double> single = losses(0, concat(args, {"--mode", "none"}), dir, "none");
  ASSERT_EQ(single.size(), 1u);
  const double expected_single = first_loss(model, 1);
  EXPECT_TRUE(
      test::within_bound(single[0], expected_single, first_loss_bound(expected_single, 1)))
      << "--mode none from the file";
  const std::vector<double> fsdp = losses(2, concat(args, {"--mode", "fsdp"}), dir, "fsdp");
  ASSERT_EQ(fsdp.size(), 1u);
  const double expected_fsdp = first_loss(model, 2);
  EXPECT_TRUE(test::within_bound(fsdp[0], expected_fsdp, first_loss_bound(expected_fsdp, 2)))
      << "--mode fsdp on 2 from the file";
}

// --mode tp and --mode fsdp_tp from the same --init-from weights and data
// as --mode none. Step 0: tensor parallelism reorders sums inside the
// forward (the row-parallel products' partial sums, the vocabulary's
// exp-sum, the replicated parameters' gradients), so each data-parallel
// slice's loss is held to the measured bound of tests/nn/gpt_sensitivity.h
// in fp32, 4 n_max u S, where S is that slice loss's response to relative
// changes of every parameter, measured in float64 on the file's model, and
// n_max = max(4 d, tokens, vocab) the longest sum; the logged loss is the
// mean of the D slices, so it is within the mean of their bounds, plus
// first_loss_bound for the mean's order. Later steps have no bound the logs
// support (see the top): the AdamW steps are checked elementwise in
// tests/tp/gpt_tp_test.cpp and gpt_fsdp_tp_test.cpp. Here both must train,
// repeat bit for bit, and write every rank's --trace.
// The mean over `slices` of each slice's bound above (tensor parallelism's
// reordered sums, from the loss's measured sensitivity).
double tensor_parallel_slices_bound(nn::GPT& model, int64_t slices) {
  const nn::GPTConfig config = model->config();
  const int64_t n_max = std::max({4 * config.n_embd, kTokens, config.vocab_size});
  double bound = 0;
  for (int64_t r = 0; r < slices; ++r) {
    const Batch batch = first_batch(r, slices);
    const nn::Sensitivity s = nn::measure_sensitivity(model, config, batch.inputs, batch.targets);
    bound += test::reordered_sum_bound(s.per_unit.at("loss"), n_max, at::kFloat) / slices;
  }
  return bound;
}

TEST(HpTrain, TensorParallelModesMatchOneProcessAtStepZero) {
  TempDir dir;
  nn::GPT model = tiny_model(99);
  const std::string weights = write_weights(dir, model);
  const Args args = concat(kTiny, {"--init-from", weights});

  for (const auto& [mode, mesh, ranks, dp] :
       std::vector<std::tuple<std::string, std::string, int, int64_t>>{
           {"tp", "2", 2, 1}, {"fsdp_tp", "2x2", 4, 2}}) {
    SCOPED_TRACE("--mode " + mode + " --mesh " + mesh);
    const Args run = concat(args, {"--mode", mode, "--mesh", mesh, "--trace",
                                   dir.file(mode + ".json")});
    const std::vector<double> curve = losses(ranks, run, dir, mode);
    ASSERT_EQ(curve.size(), 5u);
    const double expected = first_loss(model, dp);
    const double bound = tensor_parallel_slices_bound(model, dp) + first_loss_bound(expected, dp);
    EXPECT_TRUE(test::within_bound(curve[0], expected, bound)) << "step 0";
    EXPECT_LT(curve[4], curve[0] - 0.5) << "trains";
    EXPECT_EQ(losses(ranks, run, dir, mode + "_again"), curve) << "repeats";
    for (int rank = 0; rank < ranks; ++rank) {
      EXPECT_TRUE(std::ifstream(dir.file(mode + ".rank" + std::to_string(rank) + ".json")).good())
          << "rank " << rank << "'s trace";
    }
  }

  // Mixed precision under tensor parallelism: fully_shard units over a
  // data-parallel dim of one rank carry it. bf16 moves the loss off the fp32
  // curve (the header says which dtypes ran); it still trains, and fusion,
  // which changes only how collectives are packed, gives the same bits.
  const Args bf16 = concat(args, {"--mode", "tp", "--mesh", "2", "--param-dtype", "bf16",
                                  "--reduce-dtype", "fp32"});
  ProcessResult header = hp_train(2, concat(bf16, {"--steps", "1"}));
  ASSERT_EQ(header.exit_code, 0) << header.err;
  EXPECT_THAT(header.out, HasSubstr("param dtype bf16, reduce dtype fp32"));
  const std::vector<double> curve = losses(2, bf16, dir, "tp_bf16");
  ASSERT_EQ(curve.size(), 5u);
  EXPECT_NE(curve, losses(2, concat(args, {"--mode", "tp", "--mesh", "2"}), dir, "tp_fp32"));
  EXPECT_LT(curve[4], curve[0] - 0.5) << "bf16 tp trains";
  EXPECT_EQ(losses(2, concat(bf16, {"--no-comm-fusion"}), dir, "tp_bf16_per_parameter"), curve);

  // fsdp_tp needs a 2-D mesh, and heads that divide by its T.
  ProcessResult r = hp_train(4, concat(args, {"--mode", "fsdp_tp", "--mesh", "4"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err + r.out, HasSubstr("--mode fsdp_tp needs a 2-D mesh DxT"));
  r = hp_train(4, concat(args, {"--mode", "fsdp_tp", "--mesh", "1x4"}));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err + r.out, HasSubstr("must be divisible by the tensor-parallel size 4"));
}

// --activation-checkpointing blocks recomputes every block in backward:
// the same kernels on the same values, so every mode's losses equal its
// own run without checkpointing bit for bit.
TEST(HpTrain, ActivationCheckpointingKeepsTheLossesOfDataParallelModes) {
  TempDir dir;
  const Args blocks = {"--activation-checkpointing", "blocks"};
  for (const auto& [ranks, mode] : std::vector<std::pair<int, Args>>{
           {0, {"--mode", "none"}}, {2, {"--mode", "fsdp"}}, {2, {"--mode", "ddp"}}}) {
    const Args args = concat(concat(kTiny, {"--sample-tokens", "0"}), mode);
    const std::string name = mode[1];
    const std::vector<double> without = losses(ranks, args, dir, name);
    ASSERT_EQ(without.size(), 5u) << name;
    EXPECT_EQ(losses(ranks, concat(args, blocks), dir, name + "_ac"), without) << name;
  }
}

// Tensor parallelism inside pipeline stages: --pp 2 --mode tp on P x T =
// 2x2 ranks, and with fully_shard too (--mode fsdp_tp, D x P x T = 2x2x2,
// zero bubble). The bound is the one above per slice, a slice now being a
// micro-batch of a data-parallel rank (each run alone through the stages,
// as first_loss runs each slice), plus the pipeline's division of each
// micro-batch's loss by their count (ldexp(loss, -24), as in
// PipelineReplicasTrainTheOneProcessModel).
TEST(HpTrain, PipelineTensorParallelStagesMatchOneProcessAtStepZero) {
  TempDir dir;
  nn::GPT model = tiny_model(99);
  const std::string weights = write_weights(dir, model);
  const Args args = concat(kTiny, {"--init-from", weights, "--pp", "2", "--microbatches", "2",
                                   "--sample-tokens", "8"});
  for (const auto& [mode, mesh, ranks, slices] :
       std::vector<std::tuple<std::string, std::string, int, int64_t>>{
           {"tp", "2x2", 4, 2}, {"fsdp_tp", "2x2x2", 8, 4}}) {
    SCOPED_TRACE("--pp 2 --mode " + mode + " --mesh " + mesh);
    const std::vector<double> curve =
        losses(ranks, concat(args, {"--mode", mode, "--mesh", mesh}), dir, "pp_" + mode);
    ASSERT_EQ(curve.size(), 5u);
    const double expected = first_loss(model, slices);
    const double bound = tensor_parallel_slices_bound(model, slices) +
                         first_loss_bound(expected, slices) + std::ldexp(expected, -24);
    EXPECT_TRUE(test::within_bound(curve[0], expected, bound)) << "step 0";
    EXPECT_LT(curve[4], curve[0] - 0.5) << "trains";
  }
}

TEST(HpTrain, ActivationCheckpointingKeepsTheLossesOfTensorParallelism) {
  TempDir dir;
  const Args tp = concat(kTiny, {"--mode", "tp", "--mesh", "2", "--sample-tokens", "0"});
  const std::vector<double> without = losses(2, tp, dir, "tp");
  ASSERT_EQ(without.size(), 5u);
  EXPECT_EQ(losses(2, concat(tp, {"--activation-checkpointing", "blocks"}), dir, "tp_ac"),
            without);
}

TEST(HpTrain, InitFromMismatchFailsEveryRankWithTheName) {
  TempDir dir;
  nn::GPT model = tiny_model(99);
  const std::string weights = write_weights(dir, model);
  // The file holds a 2-layer model; ask for 3.
  ProcessResult r = hp_train(2, concat(kTiny, {"--init-from", weights, "--layers", "3"}));
  ASSERT_TRUE(r.exited) << describe(r);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("--init-from '" + weights + "' does not match the model"))
      << describe(r);
  EXPECT_THAT(r.err, HasSubstr("missing tensor 'h.2.ln_1.weight' (expected shape [32])"))
      << describe(r);
  // Summarised (8 problems, 5 listed), with the shape the file holds.
  EXPECT_THAT(r.err, HasSubstr("the file looks like a GPT of 2 layers, d 32, ctx 16, vocab 256"))
      << describe(r);
  const std::string rank0 = "[rank 0] ";
  size_t rank0_lines = 0;
  for (size_t at = r.err.find(rank0); at != std::string::npos; at = r.err.find(rank0, at + 1)) {
    ++rank0_lines;
  }
  EXPECT_LE(rank0_lines, 8u) << describe(r);
}

TEST(HpTrain, DataFileOfUint16Tokens) {
  TempDir dir;
  // A learnable stream over vocab 50: 2000 tokens that use only 10 ids
  // (multiples of 5), in a fixed order.
  const std::string path = dir.file("tokens.bin");
  {
    std::string bytes;
    for (int64_t i = 0; i < 2000; ++i) {
      const int64_t t = (i * i * 7 + 3) % 10 * 5;
      bytes.push_back(static_cast<char>(t & 0xff));
      bytes.push_back(static_cast<char>(t >> 8));
    }
    std::ofstream(path, std::ios::binary) << bytes;
  }
  const std::string log = dir.file("data.jsonl");
  ProcessResult r = hp_train(2, concat(kTiny, {"--data-file", path, "--vocab", "50", "--steps",
                                               "8", "--log-json", log}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  std::vector<Step> steps = read_log(log);
  ASSERT_EQ(steps.size(), 8u);
  EXPECT_NEAR(steps[0].loss, std::log(50.0), 0.3);
  EXPECT_LT(steps[7].loss, steps[0].loss - 0.5);
  EXPECT_THAT(r.out, HasSubstr("tokens.bin: 2000 uint16 tokens, vocab 50")) << describe(r);

  // Ids at or above --vocab are refused, naming the first one.
  r = hp_train(2, concat(kTiny, {"--data-file", path, "--vocab", "10"}));
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("not below --vocab 10")) << describe(r);
}

TEST(HpTrain, BadFlagsEndEveryRankBeforeAnyCollective) {
  // Every rank rejects the flag on its own: no rank waits for a peer.
  ProcessResult r = hp_train(2, concat(kTiny, {"--batch", "3"}));
  ASSERT_TRUE(r.exited && !r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hp-train: error: --batch 3 (the global batch) must be divisible "
                              "by the data-parallel size 2"))
      << describe(r);
  EXPECT_LT(r.seconds, 30);

  r = hp_train(0, {"--mode", "fsdp"});
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("--mode fsdp needs one process per rank started by a launcher"))
      << describe(r);

  // fp16 compute has no CPU kernels: refused up front with the flag, not a
  // crash in the first forward with a C++ backtrace on every rank.
  r = hp_train(2, concat(kTiny, {"--param-dtype", "fp16"}));
  ASSERT_TRUE(r.exited && !r.timed_out) << describe(r);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hp-train: error: --param-dtype fp16 is not supported"))
      << describe(r);
  EXPECT_THAT(r.err, Not(HasSubstr("frame #"))) << describe(r);
  EXPECT_THAT(r.out, Not(HasSubstr("step 1/"))) << "refused before training";

  // --device cuda where no GPU is visible: refused on every rank, naming
  // what is missing, before the process group.
  if (!compat::cuda_available()) {
    r = hp_train(2, concat(kTiny, {"--device", "cuda"}));
    ASSERT_TRUE(r.exited && !r.timed_out) << describe(r);
    EXPECT_EQ(r.exit_code, 2) << describe(r);
    EXPECT_THAT(r.err, HasSubstr("hp-train: error: --device cuda needs a")) << describe(r);
    EXPECT_LT(r.seconds, 30);
  }

  r = hp_train(0, {"--help"});
  EXPECT_EQ(r.exit_code, 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("--init-from")) << describe(r);
}

// The DTensor demo needs ranks; started on its own it says so and exits 2
// (a usage error), not abort() on an uncaught exception.
TEST(DtensorDemo, StartedWithoutALauncherExitsTwo) {
  ProcessResult r = run_process({DTENSOR_DEMO_PATH}, {"OMP_NUM_THREADS=1"}, /*limit_s=*/60);
  ASSERT_TRUE(r.exited) << describe(r);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("dtensor_demo: error: init_process_group: RANK is not set"))
      << describe(r);
  EXPECT_THAT(r.err, HasSubstr("hprun -n N")) << describe(r);
}

}  // namespace
}  // namespace hp::train
