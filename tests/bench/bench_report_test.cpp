// hp-bench's row and target tables and its row summaries (A2), without
// launching any row: the driver reads what a row is from bench/rows.h, and a
// report's targets and rows come from these pure functions.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_config.h"
#include "bench/row_summary.h"
#include "bench/rows.h"
#include "bench/targets.h"
#include "hp/util/error.h"

namespace hp::bench {
namespace {

using json = nlohmann::json;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(BenchRows, DefaultRowsEndWithThePyTorchPeersOfSingle) {
  EXPECT_THAT(row_names(),
              ElementsAre("single", "ddp", "fsdp", "fsdp_ac", "fsdp_fused",
                          "fsdp_fused_prefetch", "hsdp_fused_prefetch", "tp", "fsdp_tp",
                          "torch_single", "torch_ddp", "torch_fsdp2"));
  EXPECT_THAT(extra_row_names(), ElementsAre("ddp_unfused", "fsdp_prefetch", "checkpoint"));
}

TEST(BenchRows, TorchSingleIsAOneProcessPythonRow) {
  BenchConfig c;
  c.ranks = 3;
  const Row& row = find_row_spec("torch_single");
  EXPECT_TRUE(row.torch());
  EXPECT_STREQ(row.script, "torch_single_baseline.py");
  EXPECT_EQ(row.ranks(c), 1);
  EXPECT_EQ(row.samples_per_step(c), c.batch);
  // Our single row is the same work in one process.
  EXPECT_EQ(find_row_spec("single").ranks(c), 1);
  EXPECT_FALSE(find_row_spec("single").torch());
}

TEST(BenchRows, RanksAndSamplesFollowEachRowsLayout) {
  BenchConfig c;
  c.ranks = 3;
  c.hsdp_ranks = 4;
  c.batch = 5;
  EXPECT_EQ(find_row_spec("ddp").samples_per_step(c), 3 * 5);            // a batch per rank
  EXPECT_EQ(find_row_spec("tp").samples_per_step(c), 5);                 // one shared batch
  EXPECT_EQ(find_row_spec("fsdp_tp").ranks(c), 4);                       // (dp, tp) = (2, 2)
  EXPECT_EQ(find_row_spec("fsdp_tp").samples_per_step(c), 2 * 5);        // a batch per pair
  EXPECT_EQ(find_row_spec("hsdp_fused_prefetch").ranks(c), 4);
  EXPECT_EQ(find_row_spec("checkpoint").launcher, RowLauncher::kCheckpoint);
}

TEST(BenchRows, UnknownRowNamesItAndTheKnownOnes) {
  EXPECT_THAT([] { find_row_spec("torch_tp"); },
              ::testing::ThrowsMessage<ArgumentError>(
                  ::testing::AllOf(HasSubstr("'torch_tp'"), HasSubstr("torch_single"),
                                   HasSubstr("checkpoint"))));
}

json timed_row(const std::string& name, double median_s) {
  return {{"name", name}, {"step_time_s_median", median_s}, {"peak_bytes_per_rank", 1000}};
}

TEST(BenchTargets, SingleOverTorchSingleIsTheRatioOfMedians) {
  const json rows = json::array({timed_row("single", 0.3), timed_row("torch_single", 0.4)});
  const json t = compute_targets(rows, BenchConfig{})["single_over_torch_single"];
  EXPECT_DOUBLE_EQ(t["value"].get<double>(), 0.3 / 0.4);
  EXPECT_EQ(t["limit"], 1.0);
  EXPECT_EQ(t["pass"], true);
  EXPECT_THAT(t["what"].get<std::string>(), HasSubstr("<= 1.0"));
  const json slower = json::array({timed_row("single", 0.5), timed_row("torch_single", 0.4)});
  EXPECT_EQ(compute_targets(slower, BenchConfig{})["single_over_torch_single"]["pass"], false);
}

TEST(BenchTargets, AMissingRowLeavesTheTargetUnmeasured) {
  const json rows = json::array({timed_row("single", 0.3)});
  const json t = compute_targets(rows, BenchConfig{})["single_over_torch_single"];
  EXPECT_TRUE(t["value"].is_null());
  EXPECT_TRUE(t["pass"].is_null());
  EXPECT_EQ(t["missing"], "torch_single");
  EXPECT_EQ(target_verdict(t), "n/a ");
}

// One round of a PyTorch baseline's result line, as torch_baseline_common.py prints it.
json torch_single_run() {
  return {{"row", "torch_single"},
          {"ranks", 1},
          {"torch_version", "2.x"},
          {"step_times_s", {0.2, 0.4, 0.3}},
          {"losses", {6.0, 5.9, 5.8}},
          {"first_loss", 6.1},
          {"peak_rss_delta_bytes_per_rank", {12345}},
          {"collectives",
           {{"all_gather_per_step", 0}, {"reduce_scatter_per_step", 0},
            {"all_reduce_per_step", 0}, {"method", "none"}}}};
}

TEST(BenchSummary, TorchSingleRowIsMeasuredAsThePyTorchRows) {
  BenchConfig c;
  const json row = summarize_row(find_row_spec("torch_single"), {torch_single_run()}, c);
  EXPECT_EQ(row["ranks"], 1);
  EXPECT_DOUBLE_EQ(row["step_time_s_median"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(row["tokens_per_s"].get<double>(), c.batch * c.seq / 0.3);
  EXPECT_EQ(row["peak_bytes_per_rank"], 12345);  // the RSS delta: PyTorch counts no bytes
  EXPECT_THAT(row["peak_bytes_method"].get<std::string>(), HasSubstr("rss_delta"));
  EXPECT_EQ(row["collectives_per_step"]["total"], 0.0);
  EXPECT_TRUE(row["exposed_comm_fraction"].is_null());
  EXPECT_EQ(row["last_loss"], 5.8);
  EXPECT_FALSE(row.contains("note"));
}

TEST(BenchSummary, FailedAndSkippedRowsHaveNullFigures) {
  BenchConfig c;
  const json failed = failed_row(find_row_spec("hsdp_fused_prefetch"), "round 1: boom", c);
  EXPECT_EQ(failed["error"], "round 1: boom");
  EXPECT_TRUE(failed["step_time_s_median"].is_null());
  EXPECT_THAT(failed["note"].get<std::string>(), HasSubstr("degenerate HSDP"));
  const json skipped = skipped_row(find_row_spec("torch_fsdp2"),
                                   {{"skipped", "no FSDP2"}, {"torch_version", "1.13"}}, c);
  EXPECT_EQ(skipped["skipped"], "no FSDP2");
  EXPECT_TRUE(skipped["tokens_per_s"].is_null());
}

}  // namespace
}  // namespace hp::bench
