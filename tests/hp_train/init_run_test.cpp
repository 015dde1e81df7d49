// hp-train's --init (F17, C6): the real binary under hprun on 3 ranks
// (uneven dim-0 shards).
//
// - --init meta and --init eager train the same: each rank's shards hold the
//   same values either way (init_sharded is bit-equal to the eager init), so
//   the logged losses are equal bit for bit; meta's start-up peak is below
//   eager's on every rank (eager holds the whole model first).
// - --init meta --init-from reads a checkpoint directory saved on another
//   world size (2 ranks) and the safetensors file exported at the same
//   step: the same weights, so the same first loss, bit for bit.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tests/hp_train/hp_train_runner.h"
#include "tests/launcher/process_runner.h"

namespace hp::train {
namespace {

using launcher::testing::ProcessResult;
using launcher::testing::TempDir;
using test_run::Args;
using test_run::concat;
using test_run::describe;
using test_run::hp_train;

const Args kInitTiny = {"--layers", "2", "--d", "32", "--heads", "2", "--ctx", "16", "--seq", "16",
                    "--batch", "6", "--lr", "1e-2", "--sample-tokens", "0", "--log-every", "1"};

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(HpTrainInit, MetaTrainsAsEagerWithALowerStartupPeak) {
  TempDir dir;
  std::map<std::string, std::vector<nlohmann::json>> logs;
  for (const std::string init : {"eager", "meta"}) {
    ProcessResult run = hp_train(3, concat(kInitTiny, {"--steps", "2", "--init", init, "--log-json",
                                                   dir.file(init + ".jsonl")}));
    ASSERT_EQ(run.exit_code, 0) << describe(run);
    EXPECT_NE((run.out + run.err).find("start-up peak per rank (--init " + init), std::string::npos)
        << describe(run);
    EXPECT_NE(run.out.find("of it before the model"), std::string::npos) << describe(run);
    logs[init] = read_lines(dir.file(init + ".jsonl"));
    ASSERT_EQ(logs[init].size(), 2u);
    EXPECT_EQ(logs[init][0].at("init"), init);
  }
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(logs["meta"][s].at("loss").get<double>(), logs["eager"][s].at("loss").get<double>())
        << "step " << s;
  }
  const auto eager = logs["eager"][0].at("startup_peak_bytes").get<std::vector<int64_t>>();
  const auto meta = logs["meta"][0].at("startup_peak_bytes").get<std::vector<int64_t>>();
  ASSERT_EQ(eager.size(), 3u);
  ASSERT_EQ(meta.size(), 3u);
  for (size_t r = 0; r < 3; ++r) EXPECT_LT(meta[r], eager[r]) << "rank " << r;
  // The resident size before the model is part of the resident peak.
  for (const std::string init : {"eager", "meta"}) {
    const auto& first = logs[init][0];
    const auto before = first.at("startup_before_model_bytes").get<std::vector<int64_t>>();
    const auto peak = first.at("startup_vmhwm_bytes").get<std::vector<int64_t>>();
    ASSERT_EQ(before.size(), 3u);
    for (size_t r = 0; r < 3; ++r) {
      EXPECT_GT(before[r], 0) << init << " rank " << r;
      EXPECT_LE(before[r], peak[r]) << init << " rank " << r;
    }
  }
}

TEST(HpTrainInit, MetaReadsACheckpointFromAnotherWorldSizeAndAnExportAlike) {
  TempDir dir;
  ProcessResult saved =
      hp_train(2, concat(kInitTiny, {"--steps", "2", "--save-dir", dir.file("ckpt"), "--export",
                                 dir.file("w.safetensors")}));
  ASSERT_EQ(saved.exit_code, 0) << describe(saved);
  std::map<std::string, double> first_loss;
  for (const std::string from : {"ckpt", "w.safetensors"}) {
    ProcessResult run = hp_train(
        3, concat(kInitTiny, {"--steps", "1", "--init", "meta", "--init-from", dir.file(from),
                          "--log-json", dir.file(from + ".jsonl")}));
    ASSERT_EQ(run.exit_code, 0) << describe(run);
    EXPECT_NE((run.out + run.err).find("read only its shards"), std::string::npos) << describe(run);
    first_loss[from] = read_lines(dir.file(from + ".jsonl")).at(0).at("loss").get<double>();
  }
  EXPECT_EQ(first_loss["ckpt"], first_loss["w.safetensors"]);
}

TEST(HpTrainInit, ACheckpointDirectoryNeedsMetaInit) {
  TempDir dir;
  ProcessResult run = hp_train(
      1, concat(kInitTiny, {"--steps", "1", "--init", "eager", "--init-from", dir.path()}));
  EXPECT_EQ(run.exit_code, 2) << describe(run);
  EXPECT_NE((run.out + run.err).find("needs --init meta"), std::string::npos) << describe(run);
}

}  // namespace
}  // namespace hp::train
