// hp-train --model llama end to end (A1, N5): the real binary in every
// mode on a tiny grouped-query Llama (2 layers, d 32, 4 heads sharing 2
// key/value heads), its checkpoints and export, and its flag checks.
//
// What the logged losses are held to is what tests/hp_train/run_test.cpp
// derives for the GPT: step 0 is the seeded model's loss on the first batch
// computed here on each mode's slices, within the bound of a reordered fp32
// mean (first_loss_bound) and, under tensor parallelism, the forward's
// rounding bound 4 n_max u S measured on that model
// (tests/nn/model_sensitivity.h); later steps have no bound the logs
// support, so there every mode must lower the loss, fsdp and ddp on 2 ranks
// give the same bits (the same arithmetic, gradient clipping off), and a
// resumed run equals an uninterrupted one bit for bit.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "hp/checkpoint/safetensors.h"
#include "hp/nn/llama.h"
#include "hp/nn/loss.h"
#include "hp/util/error.h"
#include "tests/hp_train/hp_train_runner.h"
#include "tests/launcher/process_runner.h"
#include "tests/nn/model_sensitivity.h"
#include "tests/support/rounding_bounds.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/corpus.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {
namespace {

using launcher::testing::ProcessResult;
using launcher::testing::TempDir;
using test_run::Args;
using test_run::concat;
using test_run::describe;
using test_run::hp_train;
using testing::HasSubstr;

const Args kLlama = {"--model", "llama", "--layers", "2", "--d", "32", "--heads", "4",
                     "--kv-heads", "2", "--ctx", "16", "--seq", "16", "--batch", "4",
                     "--steps", "5", "--lr", "1e-2", "--sample-tokens", "8",
                     "--log-every", "1", "--grad-clip", "0"};
constexpr int64_t kLlamaTokens = 4 * 16;
using test_run::kDefaultSeed;

// The model hp-train builds for kLlama from --seed (or from `seed`).
nn::Llama tiny_llama(uint64_t seed = kDefaultSeed) {
  nn::LlamaConfig config;
  config.vocab_size = 256;
  config.context = 16;
  config.n_layer = 2;
  config.n_head = 4;
  config.n_kv_head = 2;
  config.n_embd = 32;
  config.intermediate_size = nn::llama_intermediate_size(32);
  torch::manual_seed(seed);
  return nn::Llama(config);
}

Batch batch_of(int64_t step, int64_t rank, int64_t dp_size) {
  static const at::Tensor tokens = load_fortunes().tokens;
  return batch_for_step(tokens, step, 4, 16, rank, dp_size);
}

using test_run::read_losses;

std::vector<double> run_losses(int ranks, const Args& args, const TempDir& dir,
                           const std::string& name, std::string* out = nullptr) {
  const std::string log = dir.file(name + ".jsonl");
  ProcessResult r = hp_train(ranks, concat(args, {"--log-json", log}));
  EXPECT_TRUE(r.exited && r.exit_code == 0) << name << ": " << describe(r);
  if (out != nullptr) *out = r.out;
  std::vector<double> curve;
  for (const auto& [step, loss] : read_losses(log)) curve.push_back(loss);
  return curve;
}

TEST(HpTrainLlama, EveryModeStartsFromTheSeedsModelAndTrains) {
  TempDir dir;
  nn::Llama model = tiny_llama();
  const nn::LlamaConfig config = model->config();
  const int64_t n_max =
      std::max({config.intermediate_size, config.n_embd, kLlamaTokens, config.vocab_size});
  std::map<std::string, std::vector<double>> curves;
  for (const auto& [mode, mesh, ranks, dp, tensor_parallel] :
       std::vector<std::tuple<std::string, std::string, int, int64_t, bool>>{
           {"none", "", 0, 1, false},
           {"fsdp", "2", 2, 2, false},
           {"ddp", "2", 2, 2, false},
           {"hsdp", "2x2", 4, 4, false},
           {"tp", "2", 2, 1, true},
           {"fsdp_tp", "2x2", 4, 2, true}}) {
    SCOPED_TRACE("--mode " + mode);
    Args run = concat(kLlama, {"--mode", mode});
    if (!mesh.empty()) run = concat(run, {"--mesh", mesh});
    std::string out;
    const std::vector<double> curve = run_losses(ranks, run, dir, mode, &out);
    ASSERT_EQ(curve.size(), 5u);
    EXPECT_THAT(out, HasSubstr("hp-train: Llama 2 layers, d 32, 4 heads (2 key/value), ctx 16"));
    EXPECT_THAT(out, HasSubstr("sample (8 tokens"));
    // Step 0: the seeded model on this mode's slices, as computed here.
    double expected = 0, bound = 0;
    {
      torch::NoGradGuard no_grad;
      at::set_num_threads(1);
      for (int64_t r = 0; r < dp; ++r) {
        const Batch batch = batch_of(0, r, dp);
        expected += nn::cross_entropy(model(batch.inputs), batch.targets).item<double>() / dp;
      }
    }
    if (tensor_parallel) {
      for (int64_t r = 0; r < dp; ++r) {
        const Batch batch = batch_of(0, r, dp);
        const test::ModelSensitivity s =
            test::model_sensitivity(model, config, batch.inputs, batch.targets);
        bound += test::reordered_sum_bound(s.per_unit.at("loss"), n_max, at::kFloat) / dp;
      }
    }
    bound += test::reordered_sum_bound(expected, kLlamaTokens, at::kFloat) +
             test::reordered_sum_bound(expected, dp, at::kDouble);
    EXPECT_TRUE(test::within_bound(curve[0], expected, bound)) << "step 0";
    EXPECT_LT(curve[4], curve[0] - 0.5) << "trains";
    curves[mode] = curve;
  }
  EXPECT_EQ(curves["ddp"], curves["fsdp"]) << "ddp and fsdp on 2 ranks";
}

// Resumed on the same mesh: bit for bit. The export holds Hugging Face's
// names; a checkpoint of the Llama does not resume as a GPT.
TEST(HpTrainLlama, CheckpointsResumeAndExportHuggingFaceNames) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const Args run = concat(kLlama, {"--sample-tokens", "0"});
  const std::vector<double> straight = run_losses(2, concat(run, {"--steps", "4"}), dir, "straight");
  ASSERT_EQ(straight.size(), 4u);
  ProcessResult first = hp_train(2, concat(run, {"--steps", "2", "--save-dir", ckpt}));
  ASSERT_EQ(first.exit_code, 0) << describe(first);
  const std::string exported = dir.file("llama.safetensors");
  ProcessResult resumed =
      hp_train(2, concat(run, {"--steps", "4", "--resume", ckpt, "--log-json",
                               dir.file("resumed.jsonl"), "--export", exported}));
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  const auto tail = read_losses(dir.file("resumed.jsonl"));
  ASSERT_EQ(tail.size(), 2u) << describe(resumed);
  for (const auto& [step, loss] : tail) EXPECT_EQ(loss, straight.at(step)) << "step " << step;

  std::set<std::string> names, expected;
  for (const auto& entry : checkpoint::read_safetensors(exported).tensors) {
    names.insert(entry.first);
  }
  for (const auto& p : tiny_llama()->named_parameters()) expected.insert(p.key());
  EXPECT_EQ(names, expected);
  EXPECT_TRUE(names.count("model.layers.1.self_attn.k_proj.weight"));

  ProcessResult as_gpt = hp_train(
      0, {"--mode", "none", "--layers", "2", "--d", "32", "--heads", "4", "--ctx", "16", "--seq",
          "16", "--batch", "4", "--steps", "4", "--resume", ckpt});
  EXPECT_EQ(as_gpt.exit_code, 2) << describe(as_gpt);
  EXPECT_THAT(as_gpt.err, HasSubstr("holds another model than this run builds (--model gpt"));
}

// --init-from takes a consolidated file of Hugging Face's layout by name
// (written here in reverse order): step 0 is the file's model on each
// rank's slice, within the reordered-mean bound of the test above.
TEST(HpTrainLlama, InitFromLoadsHuggingFacesLayoutByName) {
  TempDir dir;
  nn::Llama model = tiny_llama(99);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& p : model->named_parameters()) tensors.emplace_back(p.key(), p.value());
  std::reverse(tensors.begin(), tensors.end());
  const std::string weights = dir.file("hf.safetensors");
  checkpoint::write_safetensors(weights, tensors);
  const std::vector<double> curve =
      run_losses(2, concat(kLlama, {"--mode", "fsdp", "--steps", "1", "--init-from", weights}), dir,
             "init");
  ASSERT_EQ(curve.size(), 1u);
  double expected = 0;
  {
    torch::NoGradGuard no_grad;
    at::set_num_threads(1);
    for (int64_t r = 0; r < 2; ++r) {
      const Batch batch = batch_of(0, r, 2);
      expected += nn::cross_entropy(model(batch.inputs), batch.targets).item<double>() / 2;
    }
  }
  const double bound = test::reordered_sum_bound(expected, kLlamaTokens, at::kFloat) +
                       test::reordered_sum_bound(expected, 2, at::kDouble);
  EXPECT_TRUE(test::within_bound(curve[0], expected, bound));
}

TEST(HpTrainLlama, FlagsAreCheckedBeforeAnyCollective) {
  const World four{true, 0, 4};
  auto check = [&](const Args& args) {
    const TrainOptions o = parse_command_line(args).options;
    validate_options(o, resolve_parallelism(o, four));
  };
  EXPECT_THAT([&] { check({"--kv-heads", "2"}); },
              testing::ThrowsMessage<ArgumentError>(
                  HasSubstr("--kv-heads 2 applies to --model llama only")));
  EXPECT_THAT([&] { check({"--model", "llama", "--heads", "4", "--kv-heads", "3"}); },
              testing::ThrowsMessage<ArgumentError>(
                  HasSubstr("--kv-heads 3 must divide --heads 4")));
  EXPECT_THAT([&] { check({"--model", "llama", "--d", "36", "--heads", "4"}); },
              testing::ThrowsMessage<ArgumentError>(HasSubstr("must be even for --model llama")));
  EXPECT_THAT(
      [&] {
        check({"--model", "llama", "--heads", "4", "--kv-heads", "1", "--mode", "tp", "--mesh",
               "4"});
      },
      testing::ThrowsMessage<ArgumentError>(
          HasSubstr("--kv-heads 1 must be divisible by the tensor-parallel size 4")));
  EXPECT_THROW(parse_command_line({"--model", "bert"}), std::exception);
  check({"--model", "llama", "--heads", "4", "--kv-heads", "2", "--mode", "fsdp_tp", "--mesh",
         "2x2"});
}

}  // namespace
}  // namespace hp::train
