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
  EXPECT_THAT(extra_row_names(),
              ElementsAre("ddp_unfused", "fsdp_prefetch", "pp4", "pp4_gpipe", "pp4_interleaved",
                          "pp4_zero_bubble", "torch_pp4", "torch_pp4_gpipe",
                          "torch_pp4_interleaved", "torch_pp4_zero_bubble", "dp2_pp2",
                          "torch_dp2_pp2", "checkpoint"));
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

TEST(BenchSummary, EachRoundKeepsItsOwnMedian) {
  json first = torch_single_run(), second = torch_single_run();
  first["round"] = 0;
  second["round"] = 2;  // the row failed in round 1
  second["step_times_s"] = {0.5, 0.7, 0.6, 0.9};
  const json row = summarize_row(find_row_spec("torch_single"), {first, second}, BenchConfig{});
  const json& rounds = row["step_time_s_round_medians"];
  ASSERT_EQ(rounds.size(), 2u);
  EXPECT_EQ(rounds[0]["round"], 0);
  EXPECT_DOUBLE_EQ(rounds[0]["median"].get<double>(), 0.3);
  EXPECT_EQ(rounds[1]["round"], 2);
  EXPECT_DOUBLE_EQ(rounds[1]["median"].get<double>(), 0.65);
  // The row's figure still pools every step of every round.
  EXPECT_DOUBLE_EQ(row["step_time_s_median"].get<double>(), 0.5);
}

// A row whose rounds had these medians (round i the i-th, null = failed).
json row_by_round(const std::string& name, const std::vector<double>& medians, double pooled) {
  json row = timed_row(name, pooled);
  row["exposed_comm_fraction"] = nullptr;  // as a row without collectives has it
  json rounds = json::array();
  for (size_t i = 0; i < medians.size(); ++i) {
    rounds.push_back({{"round", i}, {"median", medians[i] > 0 ? json(medians[i]) : json()}});
  }
  row["step_time_s_round_medians"] = rounds;
  return row;
}

TEST(BenchTargets, AStepTimeRatioReportsEachRoundItsRangeAndWhetherTheyAgree) {
  // Round 1 of ddp failed: only rounds 0 and 2 pair.
  const json rows = json::array({row_by_round("ddp", {0.30, 0.40, 0.27}, 0.3),
                                 row_by_round("torch_ddp", {0.32, 0, 0.30}, 0.31)});
  const json t = compute_targets(rows, BenchConfig{})["ddp_over_torch_ddp"];
  EXPECT_DOUBLE_EQ(t["value"].get<double>(), 0.3 / 0.31);  // the pooled medians' ratio
  EXPECT_EQ(t["pass"], true);
  EXPECT_THAT(t["per_round"].get<std::vector<double>>(),
              ElementsAre(::testing::DoubleEq(0.30 / 0.32), ::testing::DoubleEq(0.27 / 0.30)));
  EXPECT_DOUBLE_EQ(t["range"][0].get<double>(), 0.27 / 0.30);
  EXPECT_DOUBLE_EQ(t["range"][1].get<double>(), 0.30 / 0.32);
  EXPECT_EQ(t["conclusive"], true);
  EXPECT_EQ(target_value(t), "0.9677 [0.9-0.938]");

  // One round above the limit, one below: the verdict stands but says so.
  const json mixed = json::array({row_by_round("ddp", {0.33, 0.28}, 0.3),
                                  row_by_round("torch_ddp", {0.30, 0.30}, 0.31)});
  const json m = compute_targets(mixed, BenchConfig{})["ddp_over_torch_ddp"];
  EXPECT_EQ(m["pass"], true);
  EXPECT_EQ(m["conclusive"], false);
  // Every round above the limit while the pooled medians pass (a skewed
  // round): the rounds do not back the verdict.
  const json skewed = json::array({row_by_round("ddp", {0.33, 0.32}, 0.29),
                                   row_by_round("torch_ddp", {0.30, 0.30}, 0.30)});
  const json k = compute_targets(skewed, BenchConfig{})["ddp_over_torch_ddp"];
  EXPECT_EQ(k["pass"], true);
  EXPECT_EQ(k["conclusive"], false);
  // Memory ratios have no rounds: a peak is the highest over all of them.
  const json tp = compute_targets(json::array({row_by_round("tp", {0.2, 0.2}, 0.2),
                                               row_by_round("single", {0.3, 0.3}, 0.3)}),
                                  BenchConfig{})["tp_memory_over_single"];
  EXPECT_FALSE(tp.contains("per_round"));
  EXPECT_FALSE(tp.contains("conclusive"));
}

TEST(BenchTargets, ARatioFromOneRoundHasNoRange) {
  const json rows = json::array({row_by_round("single", {0.3}, 0.3),
                                 row_by_round("torch_single", {0.4}, 0.4)});
  const json t = compute_targets(rows, BenchConfig{})["single_over_torch_single"];
  EXPECT_FALSE(t.contains("range"));
  EXPECT_EQ(target_value(t), "0.75");
}

TEST(BenchSummary, KernelWorkIsTheRanksMeanMedianOverRounds) {
  json runs = json::array();
  for (double faults : {10.0, 30.0, 2000.0}) {  // the last round: a noisy one
    json run = torch_single_run();
    run["kernel_s_per_step_per_rank"] = {0.001 * faults, 0.003 * faults};
    run["page_faults_per_step_per_rank"] = {faults, 3 * faults};
    runs.push_back(run);
  }
  const json row = summarize_row(find_row_spec("torch_single"), runs, BenchConfig{});
  // Round means 20, 60, 4000 faults; the median is the second round's.
  EXPECT_DOUBLE_EQ(row["page_faults_per_step"].get<double>(), 60.0);
  EXPECT_DOUBLE_EQ(row["kernel_ms_per_step"].get<double>(), 60.0);  // 0.06 s
  // A result line without the figures leaves them null.
  const json older =
      summarize_row(find_row_spec("torch_single"), {torch_single_run()}, BenchConfig{});
  EXPECT_TRUE(older["page_faults_per_step"].is_null());
}

TEST(BenchTargets, PageFaultsAreJudgedOnOurRowsOnly) {
  json single = timed_row("single", 0.3), ddp = timed_row("ddp", 0.3),
       torch = timed_row("torch_single", 0.3);
  single["page_faults_per_step"] = 3.0;
  ddp["page_faults_per_step"] = 12.0;
  ddp["exposed_comm_fraction"] = nullptr;  // as the summary of a row has it
  torch["page_faults_per_step"] = 2500.0;  // PyTorch's are reported, not judged
  const json t =
      compute_targets(json::array({single, ddp, torch}), BenchConfig{})["page_faults_per_step"];
  EXPECT_EQ(t["value"], 12.0);
  EXPECT_EQ(t["pass"], true);
  EXPECT_FALSE(t["each_row"].contains("torch_single"));
  // One block of 2 MiB returned and faulted in again each step: 512 pages.
  ddp["page_faults_per_step"] = 512.0;
  EXPECT_EQ(
      compute_targets(json::array({single, ddp}), BenchConfig{})["page_faults_per_step"]["pass"],
      false);
  EXPECT_TRUE(compute_targets(json::array({torch}), BenchConfig{})["page_faults_per_step"]["pass"]
                  .is_null());
}

// A GPU round of a PyTorch row: its memory is the caching allocator's peak,
// its host time per unit the issue time over the model's units.
TEST(BenchSummary, GpuRowsReportTheCachingAllocatorsPeakAndHostTimePerUnit) {
  json run = torch_single_run();
  run["device"] = "cuda";
  run["units"] = 5;
  run["host_s_per_step_per_rank"] = {0.010};
  run["cuda_peak_allocated_bytes_per_rank"] = {3000};
  run["cuda_peak_reserved_bytes_per_rank"] = {4096};
  const json row = summarize_row(find_row_spec("torch_single"), {run}, BenchConfig{});
  EXPECT_EQ(row["device"], "cuda");
  EXPECT_EQ(row["peak_bytes_per_rank"], 3000);
  EXPECT_EQ(row["cuda_peak_reserved_bytes_per_rank"], 4096);
  EXPECT_THAT(row["peak_bytes_method"].get<std::string>(), HasSubstr("caching allocator"));
  EXPECT_DOUBLE_EQ(row["host_ms_per_unit_step"].get<double>(), 2.0);  // 10 ms over 5 units
  EXPECT_TRUE(row["exposed_comm_fraction"].is_null()) << "PyTorch's waits are not ours to time";
}

// Our GPU row: the exposed share is the stream's stall over the steps'
// GPU time (mean over ranks), and the plan is judged against the GPU's peak.
TEST(BenchSummary, OurGpuRowsExposedCommIsTheStreamStallOverTheSteps) {
  json run = {{"row", "fsdp_fused_prefetch"},
              {"ranks", 2},
              {"step_times_s", {0.1, 0.1}},
              {"losses", {6.0, 5.9}},
              {"first_loss", 6.1},
              {"peak_rss_delta_bytes_per_rank", {1, 1}},
              {"peak_bytes_per_rank", {100, 100}},
              {"predicted_peak_bytes_per_rank", {90, 90}},
              {"predicted_in_flight_bytes_per_rank", {10, 10}},
              {"end_bytes_per_rank", {1, 1}},
              {"collective_counts_per_rank", {{{"all_gather", 2}}, {{"all_gather", 2}}}},
              {"comm_seconds_per_rank", {0.0, 0.0}},
              {"wait_seconds_per_rank", {0.0, 0.0}},
              {"mesh", {2}}, {"mesh_names", nullptr}, {"comm_fusion", true}, {"prefetch", true},
              {"parameters", 10}, {"block_param_bytes", 4},
              {"device", "cuda"},
              {"units", 2},
              {"host_s_per_step_per_rank", {0.004, 0.002}},
              {"cuda_peak_allocated_bytes_per_rank", {5000, 7000}},
              {"cuda_peak_reserved_bytes_per_rank", {8192, 8192}},
              {"exposed_comm_seconds_per_rank", {0.02, 0.04}}};
  BenchConfig c;
  c.ranks = 2;
  const json row = summarize_row(find_row_spec("fsdp_fused_prefetch"), {run}, c);
  EXPECT_EQ(row["peak_bytes_per_rank"], 7000);
  // (0.02 + 0.04) / 2 ranks over 0.2 s of steps.
  EXPECT_DOUBLE_EQ(row["exposed_comm_fraction"].get<double>(), 0.15);
  EXPECT_DOUBLE_EQ(row["host_ms_per_unit_step"].get<double>(), 1.5);  // 3 ms over 2 units
  // The plan is judged against the GPU's peak: (90 - 7000) / 7000.
  EXPECT_EQ(row["predicted_peak_bytes_per_rank"], 90);
  EXPECT_DOUBLE_EQ(row["plan_error"].get<double>(), (90.0 - 7000.0) / 7000.0);
}

// On a GPU the world-of-one target compares fully_shard with the model
// without it, in fp32 and one rank only; other runs leave it unmeasured.
TEST(BenchTargets, GpuWorldOfOneTargetNeedsOneRankAndFp32) {
  auto row = [](const char* name, double step) {
    return json{{"name", name},
                {"step_time_s_median", step},
                {"peak_bytes_per_rank", 1},
                {"block_param_bytes", 1},
                {"exposed_comm_fraction", nullptr},
                {"page_faults_per_step", nullptr},
                {"collectives_per_step",
                 {{"all_gather", 0.0}, {"reduce_scatter", 0.0}, {"all_reduce", 0.0}}}};
  };
  const json rows = json::array({row("single", 0.20), row("fsdp_fused_prefetch", 0.205)});
  BenchConfig c;
  c.device = "cuda";
  c.ranks = 1;
  json t = compute_targets(rows, c)["gpu_world_of_one_fsdp_over_single"];
  EXPECT_DOUBLE_EQ(t["value"].get<double>(), 0.205 / 0.20);
  EXPECT_EQ(t["pass"], true);
  c.param_dtype = "bf16";
  EXPECT_TRUE(compute_targets(rows, c)["gpu_world_of_one_fsdp_over_single"]["pass"].is_null());
  c.param_dtype = "fp32";
  c.ranks = 2;
  EXPECT_TRUE(compute_targets(rows, c)["gpu_world_of_one_fsdp_over_single"]["pass"].is_null());
  c.device = "cpu";
  EXPECT_FALSE(compute_targets(rows, c).contains("gpu_world_of_one_fsdp_over_single"));
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
