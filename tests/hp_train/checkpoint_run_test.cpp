// hp-train's checkpoints end to end (C3, C5): the real binary under hprun.
//
// - Resume on the same mesh: 3 steps, save, a new job resumes to 6; its
//   losses and its exported weights equal an uninterrupted 6-step run's
//   bit for bit (the same arithmetic on the same values: nothing to bound).
// - Resume on other meshes (HSDP 2x2 on 4 ranks, one process): the loaded
//   weights are the saved ones exactly (exported right after the load), and
//   the first resumed loss is the loss of those weights on step 3's batch as
//   computed here on that mesh's slices, within the bound of a reordered
//   fp32 mean (4 n u L, as tests/hp_train/run_test.cpp derives for step 0);
//   later steps differ by rounding that AdamW amplifies, which the
//   fully_shard parity tests bound where the weights are visible.
// - The export is read back by PyTorch (tests/checkpoint/export_check.py:
//   strict load into the PyTorch GPT, a forward) and by --init-from.
// - Under --pp (docs/pipeline.md, "Checkpoints"): resumed at the same and at
//   another pipeline degree bit for bit, with replicas (--mode ddp) too, and
//   moved to one process and back with the weights exact.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "hp/checkpoint/file_io.h"
#include "hp/checkpoint/metadata.h"
#include "hp/checkpoint/safetensors.h"
#include "hp/nn/gpt.h"
#include "hp/nn/loss.h"
#include "tools/hp_train/batches.h"
#include "tools/hp_train/corpus.h"
#include "tools/hp_train/init_weights.h"
#include "tests/hp_train/hp_train_runner.h"
#include "tests/launcher/process_runner.h"
#include "tests/support/model_configs.h"
#include "tests/support/rounding_bounds.h"
#include "tests/support/tensor_checks.h"

namespace hp::train {
namespace {

using launcher::testing::ProcessResult;
using launcher::testing::run_process;
using launcher::testing::TempDir;
using testing::HasSubstr;
using test_run::Args;

// The tiny GPT of run_test.cpp, 6 steps, gradient clipping on (a resume
// must restore everything the clip depends on too).
const Args kCkpt = {"--layers", "2", "--d", "32", "--heads", "2", "--ctx", "16", "--seq", "16",
                    "--batch", "4", "--lr", "1e-2", "--sample-tokens", "0", "--log-every", "1"};
constexpr int64_t kCkptTokens = 4 * 16;

using test_run::concat;
using test_run::describe;
using test_run::hp_train;

using test_run::read_losses;

std::map<std::string, at::Tensor> read_weights(const std::string& path) {
  std::map<std::string, at::Tensor> out;
  for (auto& [name, t] : checkpoint::read_safetensors(path).tensors) out[name] = t;
  return out;
}

void expect_same_weights(const std::string& actual, const std::string& expected,
                         const std::string& what) {
  const auto a = read_weights(actual), e = read_weights(expected);
  ASSERT_EQ(a.size(), e.size()) << what;
  for (const auto& [name, t] : e) EXPECT_TRUE(test::tensors_equal(a.at(name), t)) << what << ": " << name;
}

// A run resumed after 3 of 6 steps (dir/resumed.jsonl, .safetensors)
// against the uninterrupted one (dir/straight.*): the same losses for the
// steps it ran and the same final weights, bit for bit.
void expect_resumed_as_straight(const TempDir& dir, const ProcessResult& resumed,
                                const std::string& what) {
  const auto all = read_losses(dir.file("straight.jsonl"));
  const auto tail = read_losses(dir.file("resumed.jsonl"));
  ASSERT_EQ(tail.size(), 3u) << what << "\n" << describe(resumed);
  for (const auto& [step, loss] : tail) EXPECT_EQ(loss, all.at(step)) << what << ": step " << step;
  expect_same_weights(dir.file("resumed.safetensors"), dir.file("straight.safetensors"), what);
}

nn::GPT tiny_model_from(const std::string& weights, int64_t layers = 2) {
  nn::GPTConfig config = test::byte_gpt_config();
  config.n_layer = layers;
  nn::GPT model(config);
  load_initial_weights(*model, weights);
  return model;
}

// Step `step`'s loss as hp-train logs it on `dp_size` ranks, computed here:
// each rank's slice through the model, fp32 means averaged in double.
double loss_at(nn::GPT& model, int64_t step, int64_t dp_size) {
  static const at::Tensor tokens = load_fortunes().tokens;
  torch::NoGradGuard no_grad;
  at::set_num_threads(1);
  double sum = 0;
  for (int64_t r = 0; r < dp_size; ++r) {
    const Batch batch = batch_for_step(tokens, step, 4, 16, r, dp_size);
    sum += nn::cross_entropy(model(batch.inputs), batch.targets).item<double>();
  }
  return sum / static_cast<double>(dp_size);
}

double mean_bound(double loss, int64_t dp_size) {
  return test::reordered_sum_bound(loss, kCkptTokens, at::kFloat) +
         test::reordered_sum_bound(loss, dp_size, at::kDouble);
}

TEST(HpTrainCheckpoints, ResumeEqualsAnUninterruptedRunAndMovesToOtherMeshes) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  ProcessResult straight = hp_train(2, concat(kCkpt, {"--steps", "6", "--log-json", dir.file("straight.jsonl"),
                                                    "--export", dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);
  ProcessResult first = hp_train(2, concat(kCkpt, {"--steps", "3", "--save-dir", ckpt, "--save-every", "2",
                                                 "--export", dir.file("step3.safetensors")}));
  ASSERT_EQ(first.exit_code, 0) << describe(first);
  EXPECT_THAT(first.out, HasSubstr("[rank 0] checkpoint " + ckpt + "/step-00000002 saved: "));
  EXPECT_THAT(first.out, HasSubstr("[rank 0] checkpoint " + ckpt + "/step-00000003 saved: "));
  EXPECT_THAT(first.out, HasSubstr("[rank 0] weights exported to " + dir.file("step3.safetensors")));

  // The same mesh: bit for bit.
  ProcessResult resumed = hp_train(2, concat(kCkpt, {"--steps", "6", "--resume", ckpt, "--log-json",
                                                   dir.file("resumed.jsonl"), "--export",
                                                   dir.file("resumed.safetensors")}));
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  EXPECT_THAT(resumed.out, HasSubstr("[rank 0] resumed from " + ckpt + "/step-00000003 after 3 steps"));
  EXPECT_THAT(resumed.out, HasSubstr("[rank 0] step 4/6 | loss "));
  expect_resumed_as_straight(dir, resumed, "6 steps, resumed after 3");

  // Other meshes: the weights load exactly; the first resumed loss is those
  // weights' loss on that mesh's slices.
  nn::GPT at3 = tiny_model_from(dir.file("step3.safetensors"));
  for (const auto& [ranks, mode] : std::vector<std::pair<int, Args>>{
           {4, {"--mode", "hsdp", "--mesh", "2x2"}}, {0, {"--mode", "none"}}}) {
    const std::string name = ranks == 0 ? "none" : "hsdp";
    ProcessResult loaded = hp_train(ranks, concat(concat(kCkpt, mode), {"--steps", "3", "--resume", ckpt,
                                                                     "--export", dir.file(name + ".safetensors")}));
    ASSERT_EQ(loaded.exit_code, 0) << describe(loaded);
    expect_same_weights(dir.file(name + ".safetensors"), dir.file("step3.safetensors"), name);
    ProcessResult step = hp_train(ranks, concat(concat(kCkpt, mode), {"--steps", "4", "--resume", ckpt,
                                                                   "--log-json", dir.file(name + ".jsonl")}));
    ASSERT_EQ(step.exit_code, 0) << describe(step);
    const auto losses = read_losses(dir.file(name + ".jsonl"));
    ASSERT_EQ(losses.size(), 1u) << describe(step);
    const int64_t dp = std::max(ranks, 1);
    const double expected = loss_at(at3, 3, dp);
    EXPECT_TRUE(test::within_bound(losses.at(3), expected, mean_bound(expected, dp))) << name;
  }
}

// --save-async (C7): the checkpoints are the synchronous ones byte for byte,
// a run resumed from them equals the uninterrupted run bit for bit, and a
// save's line comes once it completed: at the next save, or after the last
// step.
TEST(HpTrainCheckpoints, AsyncSavesEqualSynchronousOnesAndResumeBitForBit) {
  TempDir dir;
  const std::string async_dir = dir.file("async"), sync_dir = dir.file("sync");
  ProcessResult straight = hp_train(2, concat(kCkpt, {"--steps", "6", "--log-json",
                                                    dir.file("straight.jsonl"), "--export",
                                                    dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);
  ProcessResult async = hp_train(2, concat(kCkpt, {"--steps", "3", "--save-dir", async_dir,
                                                 "--save-every", "1", "--save-async"}));
  ASSERT_EQ(async.exit_code, 0) << describe(async);
  ProcessResult sync = hp_train(2, concat(kCkpt, {"--steps", "3", "--save-dir", sync_dir,
                                                "--save-every", "1"}));
  ASSERT_EQ(sync.exit_code, 0) << describe(sync);
  for (int step = 1; step <= 3; ++step) {
    const std::string name = fmt::format("step-{:08d}", step);
    const std::string line = "[rank 0] checkpoint " + async_dir + "/" + name + " saved: ";
    const size_t at = async.out.find(line);
    ASSERT_NE(at, std::string::npos) << describe(async);
    EXPECT_THAT(async.out.substr(at, async.out.find('\n', at) - at),
                HasSubstr(step < 3 ? "in the background; training stalled "
                                   : "s for it after the last step"));
    // Printed once complete: after the next step's progress line.
    if (step < 3) {
      EXPECT_GT(at, async.out.find(fmt::format("step {}/3 |", step + 1))) << name;
    }
    for (const auto& file : std::filesystem::directory_iterator(sync_dir + "/" + name)) {
      const std::string file_name = file.path().filename().string();
      std::ifstream a(async_dir + "/" + name + "/" + file_name, std::ios::binary);
      std::ifstream b(file.path(), std::ios::binary);
      const std::string async_bytes{std::istreambuf_iterator<char>(a), {}};
      const std::string sync_bytes{std::istreambuf_iterator<char>(b), {}};
      EXPECT_TRUE(!sync_bytes.empty() && async_bytes == sync_bytes) << name << "/" << file_name;
    }
  }
  ProcessResult resumed = hp_train(2, concat(kCkpt, {"--steps", "6", "--resume", async_dir,
                                                   "--save-dir", async_dir, "--save-async",
                                                   "--log-json", dir.file("resumed.jsonl"),
                                                   "--export", dir.file("resumed.safetensors")}));
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  expect_resumed_as_straight(dir, resumed, "6 steps, resumed after 3 from an async checkpoint");
  // The last save completes before --export reads the weights.
  const size_t last_save =
      resumed.out.find("[rank 0] checkpoint " + async_dir + "/step-00000006 saved: ");
  ASSERT_NE(last_save, std::string::npos) << describe(resumed);
  EXPECT_LT(last_save, resumed.out.find("[rank 0] weights exported to ")) << describe(resumed);

  ProcessResult alone = hp_train(0, concat(kCkpt, {"--steps", "1", "--save-async"}));
  EXPECT_EQ(alone.exit_code, 2) << describe(alone);
  EXPECT_THAT(alone.err, HasSubstr("--save-async needs --save-dir DIR"));
}

// Tensor parallelism (its fused QKV weight is a StridedShard): resumed on
// the same mesh bit for bit, and its checkpoint loads exactly into one
// process.
TEST(HpTrainCheckpoints, TensorParallelResumesAndMovesToOneProcess) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const Args tp = concat(kCkpt, {"--mode", "tp", "--mesh", "2"});
  ProcessResult straight = hp_train(2, concat(tp, {"--steps", "6", "--log-json",
                                                 dir.file("straight.jsonl"), "--export",
                                                 dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);
  ProcessResult first = hp_train(2, concat(tp, {"--steps", "3", "--save-dir", ckpt, "--export",
                                              dir.file("step3.safetensors")}));
  ASSERT_EQ(first.exit_code, 0) << describe(first);
  ProcessResult resumed = hp_train(2, concat(tp, {"--steps", "6", "--resume", ckpt, "--log-json",
                                                dir.file("resumed.jsonl"), "--export",
                                                dir.file("resumed.safetensors")}));
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  expect_resumed_as_straight(dir, resumed, "tp: 6 steps, resumed after 3");
  ProcessResult one = hp_train(0, concat(kCkpt, {"--mode", "none", "--steps", "3", "--resume", ckpt,
                                               "--export", dir.file("none.safetensors")}));
  ASSERT_EQ(one.exit_code, 0) << describe(one);
  expect_same_weights(dir.file("none.safetensors"), dir.file("step3.safetensors"),
                      "tp's checkpoint in one process");
}

// --resume auto, as a job that restarts itself runs it: the first attempt
// starts from scratch; an attempt interrupted after logging steps past its
// last checkpoint is continued from that checkpoint, and the log ends with
// one line per step, equal to an uninterrupted run's bit for bit.
TEST(HpTrainCheckpoints, ResumeAutoStartsFromScratchThenContinuesTheRunAndItsLog) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  ProcessResult straight = hp_train(2, concat(kCkpt, {"--steps", "6", "--log-json",
                                                    dir.file("straight.jsonl"), "--export",
                                                    dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);
  const Args automatic = concat(kCkpt, {"--save-dir", ckpt, "--save-every", "2", "--resume",
                                        "auto", "--log-json", dir.file("auto.jsonl")});
  ProcessResult first = hp_train(2, concat(automatic, {"--steps", "3"}));
  ASSERT_EQ(first.exit_code, 0) << describe(first);
  EXPECT_THAT(first.out, HasSubstr("--resume auto: no complete checkpoint in " + ckpt +
                                   " yet; starting from step 0"));
  // As if the job had died after logging step 2 but before saving step 3.
  std::filesystem::remove_all(ckpt + "/step-00000003");
  ProcessResult resumed = hp_train(2, concat(automatic, {"--steps", "6", "--export",
                                                       dir.file("resumed.safetensors")}));
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  EXPECT_THAT(resumed.out, HasSubstr("resumed from " + ckpt + "/step-00000002 after 2 steps"));
  const auto all = read_losses(dir.file("straight.jsonl"));
  std::vector<int64_t> steps;
  std::ifstream log(dir.file("auto.jsonl"));
  for (std::string line; std::getline(log, line);) {
    const auto j = nlohmann::json::parse(line);
    steps.push_back(j.at("step").get<int64_t>());
    EXPECT_EQ(j.at("loss").get<double>(), all.at(steps.back())) << "step " << steps.back();
  }
  EXPECT_EQ(steps, (std::vector<int64_t>{0, 1, 2, 3, 4, 5}));
  expect_same_weights(dir.file("resumed.safetensors"), dir.file("straight.safetensors"),
                      "6 steps under --resume auto, resumed after 2");
}

TEST(HpTrainCheckpoints, ResumeOfAnotherModelFailsBeforeTraining) {
  TempDir dir;
  ProcessResult saved = hp_train(0, concat(kCkpt, {"--steps", "1", "--save-dir", dir.file("c")}));
  ASSERT_EQ(saved.exit_code, 0) << describe(saved);
  ProcessResult other = hp_train(2, concat(kCkpt, {"--steps", "2", "--d", "64", "--resume", dir.file("c")}));
  EXPECT_EQ(other.exit_code, 2) << describe(other);
  EXPECT_THAT(other.err, HasSubstr("--resume '" + dir.file("c") + "/step-00000001' holds another model"));
  EXPECT_THAT(other.err, HasSubstr("'wpe.weight' has shape [16, 32] in the checkpoint, [16, 64] in this run"));
  EXPECT_THAT(other.out, testing::Not(HasSubstr("step 1/"))) << "nothing trained";
  ProcessResult beyond = hp_train(0, concat(kCkpt, {"--steps", "1", "--resume", dir.file("c"), "--d", "32"}));
  EXPECT_EQ(beyond.exit_code, 0) << describe(beyond);  // saved at 1 of 1: nothing left to train
  ProcessResult none = hp_train(0, concat(kCkpt, {"--steps", "2", "--resume", dir.file("nothing")}));
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.err, HasSubstr("holds no complete checkpoint"));
}

// A restarted job whose newest checkpoint is damaged: step 6's metadata is
// corrupt, a chunk of step 4 fails its checksum, and a replace of step 2
// stopped between its renames (.old-step-2, no step-2). --resume auto
// recovers step 2, skips 6 and 4 saying why, resumes from 2, and ends with
// the uninterrupted run's losses, one log line per step.
TEST(HpTrainCheckpoints, ADamagedNewestCheckpointFallsBackToAnIntactOne) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const Args automatic = concat(kCkpt, {"--steps", "6", "--save-dir", ckpt, "--save-every", "2",
                                        "--resume", "auto", "--log-json", dir.file("auto.jsonl")});
  ProcessResult first = hp_train(2, automatic);
  ASSERT_EQ(first.exit_code, 0) << describe(first);
  const auto straight = read_losses(dir.file("auto.jsonl"));
  ASSERT_EQ(straight.size(), 6u);
  auto flip = [](const std::string& path, uint64_t offset) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << path;
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(static_cast<std::streamoff>(offset));
    f.write(&c, 1);
  };
  flip(ckpt + "/step-00000006/metadata.json", 40);
  const std::string four = ckpt + "/step-00000004";
  const auto metadata = checkpoint::Metadata::parse(
      checkpoint::read_whole_file(four + "/metadata.json"), four + "/metadata.json");
  const checkpoint::ChunkRecord& chunk = metadata.tensors.front().second.chunks.front();
  flip(four + "/" + chunk.file, chunk.byte_offset + chunk.bytes / 2);
  std::filesystem::rename(ckpt + "/step-00000002", ckpt + "/.old-step-00000002");

  ProcessResult resumed = hp_train(2, automatic);
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  EXPECT_THAT(resumed.err, HasSubstr("skipping " + ckpt + "/step-00000006, which fails its checks"));
  EXPECT_THAT(resumed.err, HasSubstr("recovered " + ckpt + "/step-00000002 from " + ckpt +
                                     "/.old-step-00000002"));
  EXPECT_THAT(resumed.err, HasSubstr("skipping " + four + ", which fails its checks"));
  EXPECT_THAT(resumed.out, HasSubstr("resumed from " + ckpt + "/step-00000002 after 2 steps"));
  EXPECT_THAT(resumed.out, HasSubstr("[rank 0] step 3/6 | loss "));
  EXPECT_EQ(read_losses(dir.file("auto.jsonl")), straight) << describe(resumed);
}

// Two jobs saving into one --save-dir: the second stops before it trains,
// naming the job that holds the directory (here the test, holding the lock
// as that job's rank 0 would).
TEST(HpTrainCheckpoints, ASecondJobSavingIntoTheSameDirStopsNamingTheFirst) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  std::filesystem::create_directories(ckpt);
  const int held = ::open((ckpt + "/.hp-save.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(held, 0);
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "host trainer-7 pid 31337 run 0123456789abcdef since earlier\n";
  ASSERT_EQ(::write(held, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  ProcessResult second = hp_train(2, concat(kCkpt, {"--steps", "2", "--save-dir", ckpt}));
  ::close(held);
  EXPECT_NE(second.exit_code, 0) << describe(second);
  EXPECT_THAT(second.err, HasSubstr("checkpoint root " + ckpt + " is in use by another job"));
  EXPECT_THAT(second.err, HasSubstr("host trainer-7 pid 31337 run 0123456789abcdef"));
  EXPECT_THAT(second.out, testing::Not(HasSubstr("step 1/"))) << "nothing trained";
}

TEST(HpTrainCheckpoints, ExportReadsBackInPyTorchAndThroughInitFrom) {
  TempDir dir;
  const std::string weights = dir.file("w.safetensors");
  ProcessResult r = hp_train(2, concat(kCkpt, {"--steps", "2", "--export", weights}));
  ASSERT_EQ(r.exit_code, 0) << describe(r);
  nn::GPT model = tiny_model_from(weights);  // names and shapes are the model's

  // PyTorch: strict load by name, then the loss of step 2's batch, which
  // runs the same libtorch kernels as ours on the same weights; the bound
  // allows the reordered mean only.
  static const at::Tensor tokens = load_fortunes().tokens;
  const Batch batch = batch_for_step(tokens, 2, 4, 16, 0, 1);
  nlohmann::json cfg = {{"vocab_size", 256}, {"context", 16}, {"n_layer", 2}, {"n_head", 2},
                        {"n_embd", 32}};
  for (const char* field : {"idx", "targets"}) {
    const at::Tensor t = std::string(field) == "idx" ? batch.inputs : batch.targets;
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t i = 0; i < t.size(0); ++i) {
      rows.push_back(std::vector<int64_t>(t[i].data_ptr<int64_t>(), t[i].data_ptr<int64_t>() + t.size(1)));
    }
    cfg[field] = rows;
  }
  std::ofstream(dir.file("cfg.json")) << cfg.dump();
  ProcessResult py = run_process({HP_PYTHON, HP_SOURCE_DIR "/tests/checkpoint/export_check.py",
                                  weights, dir.file("cfg.json"), dir.file("out.json")},
                                 {}, 120);
  ASSERT_EQ(py.exit_code, 0) << describe(py);
  std::ifstream in(dir.file("out.json"));
  const auto out = nlohmann::json::parse(in);
  EXPECT_EQ(out.at("names").size(), model->named_parameters().size());
  const double ours = loss_at(model, 2, 1);
  EXPECT_TRUE(test::within_bound(out.at("loss").get<double>(), ours, mean_bound(ours, 1)));

  // --init-from: training starts from the exported weights.
  ProcessResult init = hp_train(2, concat(kCkpt, {"--steps", "1", "--init-from", weights, "--log-json",
                                                dir.file("init.jsonl")}));
  ASSERT_EQ(init.exit_code, 0) << describe(init);
  const double expected = loss_at(model, 0, 2);
  EXPECT_TRUE(test::within_bound(read_losses(dir.file("init.jsonl")).at(0), expected,
                                 mean_bound(expected, 2)));
}


// --- pipeline checkpoints (docs/pipeline.md, "Checkpoints") ---

// kCkpt on 4 blocks, so that --pp 4 has a block per stage, and 4
// micro-batches of one sample at every degree: a pipeline at --pp 2 and at
// --pp 4 then runs the same ops on the same values in the same micro-batch
// order (the stages only decide on which rank each runs, as
// run_test.cpp's PipelineSchedulesTrainTheOneProcessModel shows for the
// schedules), so they are compared bit for bit. Gradient clipping is off:
// its norm is summed over the pipeline's ranks, two partial sums at --pp 2
// and four at --pp 4, which may round differently.
const Args kPipeline = concat(kCkpt, {"--layers", "4", "--microbatches", "4", "--grad-clip", "0"});

// The keys of the checkpoint in `dir` (a step-N directory), sorted.
std::vector<std::string> checkpoint_keys(const std::string& dir) {
  const auto metadata = checkpoint::Metadata::parse(
      checkpoint::read_whole_file(dir + "/metadata.json"), dir + "/metadata.json");
  std::vector<std::string> keys;
  for (const auto& [key, record] : metadata.tensors) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  return keys;
}

// Saved at --pp 2 after 4 of 8 steps: resumed at --pp 2 and at --pp 4, the
// losses of steps 4-7 and the final weights (--export, gathered on rank 0)
// are the uninterrupted run's bit for bit.
TEST(HpTrainCheckpoints, PipelineResumesBitForBitAtItsOwnAndAnotherDegree) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const Args pp2 = concat(kPipeline, {"--pp", "2"});
  // The uninterrupted run, saving after step 4 on the way.
  ProcessResult straight = hp_train(2, concat(pp2, {"--steps", "8", "--save-dir", ckpt,
                                                  "--save-every", "4", "--log-json",
                                                  dir.file("straight.jsonl"), "--export",
                                                  dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);
  EXPECT_THAT(straight.out, HasSubstr("[rank 0] checkpoint " + ckpt + "/step-00000004 saved: "));
  EXPECT_THAT(straight.out, HasSubstr("[rank 0] weights exported to " + dir.file("straight.safetensors")));
  std::filesystem::remove_all(ckpt + "/step-00000008");
  const auto all = read_losses(dir.file("straight.jsonl"));
  ASSERT_EQ(all.size(), 8u) << describe(straight);
  for (const auto& [ranks, args] : std::vector<std::pair<int, Args>>{
           {2, pp2}, {4, concat(kPipeline, {"--pp", "4"})}}) {
    const std::string name = fmt::format("pp{}", ranks);
    ProcessResult resumed = hp_train(ranks, concat(args, {"--steps", "8", "--resume", ckpt,
                                                        "--log-json", dir.file(name + ".jsonl"),
                                                        "--export", dir.file(name + ".safetensors")}));
    ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
    EXPECT_THAT(resumed.out, HasSubstr("[rank 0] resumed from " + ckpt + "/step-00000004 after 4 steps"));
    const auto tail = read_losses(dir.file(name + ".jsonl"));
    ASSERT_EQ(tail.size(), 4u) << name << "\n" << describe(resumed);
    for (const auto& [step, loss] : tail) EXPECT_EQ(loss, all.at(step)) << name << ": step " << step;
    expect_same_weights(dir.file(name + ".safetensors"), dir.file("straight.safetensors"), name);
  }
}

// A --pp 2 checkpoint is a whole model's, key for key: one process resumes
// it with the weights exact, --pp 2 resumes one process's, and --init-from
// reads a --pp 2 export and a checkpoint directory into the stages.
//
// One process runs step 4 on the batch of 4 in one pass, the pipeline in 4
// passes of one sample: the matmuls may block differently by shape
// (run_test.cpp), so their losses are not compared with each other bit for
// bit. Each is held to the loss of the loaded weights computed here at its
// own shapes: one process's within mean_bound, as the other meshes above;
// the pipeline's per-sample fp32 means (the micro-batches' shapes), each
// divided by 4 (exact) and added in fp32, within mean_bound for 4 plus
// those three additions' roundings, each at most 2^-24 of a partial sum (at
// most the loss). Later steps differ by roundings that AdamW amplifies, which
// no bound from the logs covers (run_test.cpp).
TEST(HpTrainCheckpoints, PipelineCheckpointsMoveToOneProcessAndBack) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt"), single = dir.file("single");
  const Args pp2 = concat(kPipeline, {"--pp", "2"});
  const Args one = concat(concat(kCkpt, {"--layers", "4", "--grad-clip", "0"}), {"--mode", "none"});
  ProcessResult saved = hp_train(2, concat(pp2, {"--steps", "4", "--save-dir", ckpt, "--export",
                                               dir.file("pp_at4.safetensors")}));
  ASSERT_EQ(saved.exit_code, 0) << describe(saved);

  // One process: the weights exactly (exported before any step), then step 4.
  ProcessResult loaded = hp_train(0, concat(one, {"--steps", "4", "--resume", ckpt, "--export",
                                                dir.file("one_at4.safetensors")}));
  ASSERT_EQ(loaded.exit_code, 0) << describe(loaded);
  EXPECT_THAT(loaded.out, HasSubstr("no step to run"));
  expect_same_weights(dir.file("one_at4.safetensors"), dir.file("pp_at4.safetensors"),
                      "--pp 2's checkpoint in one process");
  ProcessResult step = hp_train(0, concat(one, {"--steps", "5", "--resume", ckpt, "--log-json",
                                              dir.file("one.jsonl")}));
  ASSERT_EQ(step.exit_code, 0) << describe(step);
  ProcessResult pipeline_step = hp_train(2, concat(pp2, {"--steps", "5", "--resume", ckpt,
                                                       "--log-json", dir.file("pp.jsonl")}));
  ASSERT_EQ(pipeline_step.exit_code, 0) << describe(pipeline_step);
  nn::GPT at4 = tiny_model_from(dir.file("pp_at4.safetensors"), 4);
  const double whole = loss_at(at4, 4, 1), per_sample = loss_at(at4, 4, 4);
  EXPECT_TRUE(test::within_bound(read_losses(dir.file("one.jsonl")).at(4), whole,
                                 mean_bound(whole, 1)))
      << "one process, step 4";
  EXPECT_TRUE(test::within_bound(read_losses(dir.file("pp.jsonl")).at(4), per_sample,
                                 mean_bound(per_sample, 4) + 3 * std::ldexp(per_sample, -24)))
      << "--pp 2, step 4";

  // And back: one process's checkpoint into --pp 2's stages, exactly; the
  // two checkpoints have the same keys.
  ProcessResult one_saved = hp_train(0, concat(one, {"--steps", "2", "--save-dir", single,
                                                   "--export", dir.file("one_at2.safetensors")}));
  ASSERT_EQ(one_saved.exit_code, 0) << describe(one_saved);
  EXPECT_EQ(checkpoint_keys(ckpt + "/step-00000004"), checkpoint_keys(single + "/step-00000002"));
  ProcessResult back = hp_train(2, concat(pp2, {"--steps", "2", "--resume", single, "--export",
                                              dir.file("pp_at2.safetensors")}));
  ASSERT_EQ(back.exit_code, 0) << describe(back);
  expect_same_weights(dir.file("pp_at2.safetensors"), dir.file("one_at2.safetensors"),
                      "one process's checkpoint at --pp 2");

  // --init-from: the export at --pp 2, the checkpoint directory at --pp 4,
  // the same weights: the same step-0 loss bit for bit (see kPipeline).
  ProcessResult from_file = hp_train(2, concat(pp2, {"--steps", "1", "--init-from",
                                                   dir.file("pp_at4.safetensors"), "--log-json",
                                                   dir.file("init_file.jsonl")}));
  ASSERT_EQ(from_file.exit_code, 0) << describe(from_file);
  EXPECT_THAT(from_file.out, HasSubstr("each rank read only its stages from"));
  ProcessResult from_dir = hp_train(4, concat(kPipeline, {"--pp", "4", "--steps", "1",
                                                        "--init-from", ckpt, "--log-json",
                                                        dir.file("init_dir.jsonl")}));
  ASSERT_EQ(from_dir.exit_code, 0) << describe(from_dir);
  const double initial = read_losses(dir.file("init_file.jsonl")).at(0);
  EXPECT_EQ(read_losses(dir.file("init_dir.jsonl")).at(0), initial);
  const double expected = loss_at(at4, 0, 4);
  EXPECT_TRUE(test::within_bound(initial, expected,
                                 mean_bound(expected, 4) + 3 * std::ldexp(expected, -24)))
      << "--init-from at --pp 2, step 0";

  // The other modes' check of --resume: another model fails before training.
  ProcessResult other = hp_train(2, concat(pp2, {"--steps", "6", "--d", "64", "--resume", ckpt}));
  EXPECT_EQ(other.exit_code, 2) << describe(other);
  EXPECT_THAT(other.err, HasSubstr("--resume '" + ckpt + "/step-00000004' holds another model"));
  EXPECT_THAT(other.out, testing::Not(HasSubstr("step 1/"))) << "nothing trained";
}

// Replicas of a pipeline (--mode ddp --pp 2 on 4 ranks, mesh (dp, pp)),
// with gradient clipping and --save-async: the run resumed after 4 of 8
// steps is the uninterrupted one bit for bit (the same degree: the same
// arithmetic).
TEST(HpTrainCheckpoints, PipelineReplicasResumeBitForBit) {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const Args replicas = concat(kCkpt, {"--layers", "4", "--pp", "2", "--mode", "ddp",
                                       "--microbatches", "2"});
  ProcessResult straight = hp_train(4, concat(replicas, {"--steps", "8", "--save-dir", ckpt,
                                                       "--save-every", "4", "--save-async",
                                                       "--log-json", dir.file("straight.jsonl"),
                                                       "--export", dir.file("straight.safetensors")}));
  ASSERT_EQ(straight.exit_code, 0) << describe(straight);
  EXPECT_THAT(straight.out, HasSubstr("[rank 0] checkpoint " + ckpt + "/step-00000004 saved: "));
  std::filesystem::remove_all(ckpt + "/step-00000008");
  ProcessResult resumed = hp_train(4, concat(replicas, {"--steps", "8", "--resume", ckpt,
                                                      "--log-json", dir.file("resumed.jsonl"),
                                                      "--export", dir.file("resumed.safetensors")}));
  ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
  const auto all = read_losses(dir.file("straight.jsonl"));
  const auto tail = read_losses(dir.file("resumed.jsonl"));
  ASSERT_EQ(tail.size(), 4u) << describe(resumed);
  for (const auto& [step, loss] : tail) EXPECT_EQ(loss, all.at(step)) << "step " << step;
  expect_same_weights(dir.file("resumed.safetensors"), dir.file("straight.safetensors"),
                      "dp 2 x pp 2, resumed after 4");
}

// Sharded and tensor-parallel stages save whole tensors too (each gathered
// over the stage's ranks): resumed on their own layout they continue bit
// for bit, and fully_shard's checkpoint resumes as replicas of the pipeline
// (--mode ddp), which train bit for bit like fully_shard'ed stages
// (HpTrain.PipelineShardedStagesTrainLikeReplicas). HSDP stages of 2
// replicas (2x1x2: a stage's holders are both replicas' ranks) resume on
// their own mesh.
TEST(HpTrainCheckpoints, PipelineShardedStagesResumeBitForBit) {
  TempDir dir;
  for (const auto& [mode, mesh] : std::vector<std::pair<std::string, std::string>>{
           {"fsdp", "2x2"}, {"tp", "2x2"}, {"hsdp", "2x1x2"}}) {
    SCOPED_TRACE("--pp 2 --mode " + mode);
    const std::string ckpt = dir.file("ckpt_" + mode);
    const Args run = concat(kCkpt, {"--layers", "4", "--pp", "2", "--mode", mode, "--mesh", mesh,
                                    "--microbatches", "2"});
    ProcessResult straight = hp_train(
        4, concat(run, {"--steps", "8", "--save-dir", ckpt, "--save-every", "4", "--log-json",
                        dir.file(mode + "_straight.jsonl"), "--export",
                        dir.file(mode + "_straight.safetensors")}));
    ASSERT_EQ(straight.exit_code, 0) << describe(straight);
    std::filesystem::remove_all(ckpt + "/step-00000008");
    const auto all = read_losses(dir.file(mode + "_straight.jsonl"));
    std::vector<std::pair<std::string, Args>> resumes = {{mode, run}};
    if (mode == "fsdp") {
      resumes.emplace_back("ddp", concat(kCkpt, {"--layers", "4", "--pp", "2", "--mode", "ddp",
                                                 "--microbatches", "2"}));
    }
    for (const auto& [as, args] : resumes) {
      const std::string tag = mode + "_as_" + as;
      ProcessResult resumed = hp_train(
          4, concat(args, {"--steps", "8", "--resume", ckpt, "--log-json",
                           dir.file(tag + ".jsonl"), "--export", dir.file(tag + ".safetensors")}));
      ASSERT_EQ(resumed.exit_code, 0) << describe(resumed);
      const auto tail = read_losses(dir.file(tag + ".jsonl"));
      ASSERT_EQ(tail.size(), 4u) << describe(resumed);
      for (const auto& [step, loss] : tail) EXPECT_EQ(loss, all.at(step)) << tag << " step " << step;
      expect_same_weights(dir.file(tag + ".safetensors"), dir.file(mode + "_straight.safetensors"),
                          tag);
    }
  }
}

}  // namespace
}  // namespace hp::train
