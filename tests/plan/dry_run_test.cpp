// hp-train --dry-run (P2): the real binary prints each rank's memory plan,
// writes one JSON object per rank and exits 0 without a training step or a
// collective.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <string>
#include <vector>

#include "hp/plan/memory_plan.h"
#include "tests/hp_train/hp_train_runner.h"
#include "tests/launcher/process_runner.h"
#include "tools/hp_train/dry_run.h"
#include "tools/hp_train/train_options.h"

namespace hp::train {
namespace {

using launcher::testing::ProcessResult;
using launcher::testing::run_process;
using launcher::testing::TempDir;
using test_run::Args;
using test_run::concat;
using test_run::describe;
using test_run::hp_train;
using ::testing::HasSubstr;
using ::testing::Not;

// Fortunes as bytes: vocabulary 256.
const Args kTiny = {"--layers", "2",  "--d",   "32", "--heads", "2",
                    "--ctx",    "16", "--seq", "16", "--batch", "4"};

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

TEST(DryRun, EveryRankPrintsItsPlanAndRankZeroWritesOneObjectPerRank) {
  TempDir dir;
  const std::string log = dir.file("plan/plans.jsonl");
  ProcessResult r = hp_train(2, concat(kTiny, {"--dry-run", "--log-json", log}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  for (const std::string& part : std::vector<std::string>{
           "[rank 0] memory plan of rank 0 (MiB)", "[rank 1] memory plan of rank 1 (MiB)",
        "[rank 0]   activations", "[rank 1]   communication", "steady step peaks at: ",
        "[rank 0] memory plans written to " + log}) {
    EXPECT_THAT(r.out, HasSubstr(part)) << describe(r);
  }
  EXPECT_THAT(r.out, Not(HasSubstr("step 1/"))) << "no step runs";

  // The same plans as the library computes for these flags.
  CommandLine command_line = parse_command_line(concat(kTiny, {"--mode", "fsdp"}));
  World world{true, 0, 2};
  const Parallelism parallelism = resolve_parallelism(command_line.options, world);
  const std::vector<nlohmann::json> lines = read_lines(log);
  ASSERT_EQ(lines.size(), 2u) << describe(r);
  for (int rank = 0; rank < 2; ++rank) {
    const nlohmann::json& line = lines[rank];
    const plan::MemoryPlan expected =
        plan::plan_memory(plan_options(command_line.options, parallelism, 256, rank));
    EXPECT_EQ(line["rank"], rank);
    EXPECT_EQ(line["predicted_peak_bytes"].get<int64_t>(), expected.peak_bytes());
    int64_t sum = 0;
    for (int t = 0; t < plan::kTermCount; ++t) {
      const std::string key = std::string(plan::term_name(static_cast<plan::Term>(t))) + "_bytes";
      ASSERT_TRUE(line.contains(key)) << key << " in " << line.dump();
      sum += line[key].get<int64_t>();
    }
    EXPECT_EQ(sum, line["predicted_peak_bytes"].get<int64_t>()) << "the terms add up";
  }
}

// A Llama (with grouped-query attention) is planned as the Llama it is: the
// plan of its own config, not the GPT's of the same flags.
TEST(DryRun, PlansTheLlamaItWouldTrain) {
  TempDir dir;
  const std::string log = dir.file("plans.jsonl");
  const Args llama = concat(kTiny, {"--model", "llama", "--kv-heads", "1"});
  ProcessResult r = hp_train(2, concat(llama, {"--dry-run", "--log-json", log}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("[rank 1] memory plan of rank 1 (MiB)")) << describe(r);
  EXPECT_THAT(r.out, Not(HasSubstr("step 1/"))) << "no step runs";

  World world{true, 0, 2};
  const CommandLine as_llama = parse_command_line(concat(llama, {"--mode", "fsdp"}));
  const CommandLine as_gpt = parse_command_line(concat(kTiny, {"--mode", "fsdp"}));
  const Parallelism parallelism = resolve_parallelism(as_llama.options, world);
  const std::vector<nlohmann::json> lines = read_lines(log);
  ASSERT_EQ(lines.size(), 2u) << describe(r);
  for (int rank = 0; rank < 2; ++rank) {
    const plan::MemoryPlan expected =
        plan::plan_memory(plan_options(as_llama.options, parallelism, 256, rank));
    const plan::MemoryPlan gpt =
        plan::plan_memory(plan_options(as_gpt.options, parallelism, 256, rank));
    EXPECT_EQ(lines[rank]["predicted_peak_bytes"].get<int64_t>(), expected.peak_bytes());
    EXPECT_NE(expected.peak_bytes(), gpt.peak_bytes()) << "a Llama's plan, not a GPT's";
  }
}

TEST(DryRun, JoinsNoProcessGroup) {
  // A rank of a world of two whose rendezvous address has nobody behind it:
  // joining would wait for the store until it timed out.
  const ProcessResult r = run_process(
      concat(concat({HP_TRAIN_PATH}, test_run::kOnTheCpu), concat(kTiny, {"--dry-run"})),
      {"OMP_NUM_THREADS=1", "RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "LOCAL_WORLD_SIZE=2",
       "MASTER_ADDR=127.0.0.1", "MASTER_PORT=9", "HP_TIMEOUT_S=60"},
      /*limit_s=*/30);
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("memory plan of rank 1 (MiB)")) << describe(r);
}

// Planning a GPU run needs no GPU: the plan is the same arithmetic, and it
// says what on a GPU it leaves out.
TEST(DryRun, PlansAGpuRunWithoutAGpuAndNamesWhatItLeavesOut) {
  const ProcessResult r = hp_train(0, concat(kTiny, {"--dry-run", "--mode", "none", "--device",
                                                     "cuda"}));
  ASSERT_TRUE(r.exited && r.exit_code == 0) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("memory plan of rank 0 (MiB)")) << describe(r);
  EXPECT_THAT(r.out, HasSubstr("on a GPU this predicts the caching allocator's allocated peak"))
      << describe(r);
  EXPECT_THAT(r.out, HasSubstr("not planned: cuBLAS and cuDNN workspaces")) << describe(r);
  const ProcessResult host = hp_train(0, concat(kTiny, {"--dry-run", "--mode", "none",
                                                        "--device", "cpu"}));
  ASSERT_TRUE(host.exited && host.exit_code == 0) << describe(host);
  EXPECT_THAT(host.out, Not(HasSubstr("caching allocator"))) << describe(host);
}

TEST(DryRun, BadFlagsStillFailBeforeAnything) {
  const ProcessResult r = hp_train(2, concat(kTiny, {"--dry-run", "--batch", "3"}));
  ASSERT_TRUE(r.exited) << describe(r);
  EXPECT_EQ(r.exit_code, 2) << describe(r);
  EXPECT_THAT(r.err, HasSubstr("--batch 3 (the global batch) must be divisible")) << describe(r);
}

}  // namespace
}  // namespace hp::train
