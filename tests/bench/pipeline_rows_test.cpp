// hp-bench's pipeline rows without launching them: what each runs (the row
// table), the measured bubble computed from the workers' per-step times, the
// report row and the ours-over-PyTorch targets.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_config.h"
#include "bench/pipeline_bubble.h"
#include "bench/row_summary.h"
#include "bench/rows.h"
#include "bench/targets.h"
#include "hp/util/error.h"

namespace hp::bench {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

TEST(PipelineRows, EachRowAndItsTorchTwinRunOneScheduleOnFourRanksSharingABatch) {
  BenchConfig c;
  c.ranks = 2;
  c.batch = 16;
  const std::vector<std::pair<std::string, std::pair<std::string, int>>> expected = {
      {"pp4", {"1f1b", 1}},
      {"pp4_gpipe", {"gpipe", 1}},
      {"pp4_interleaved", {"interleaved", 2}},
      {"pp4_zero_bubble", {"zero-bubble", 2}}};
  for (const auto& [name, schedule] : expected) {
    for (const std::string& row_name : {name, "torch_" + name}) {
      const Row& row = find_row_spec(row_name);
      const PipelineRow* pp = pipeline_row(row);
      ASSERT_NE(pp, nullptr) << row_name;
      EXPECT_EQ(pp->schedule, schedule.first) << row_name;
      EXPECT_EQ(pp->stages_per_rank, schedule.second) << row_name;
      EXPECT_EQ(pp->data_parallel, 1) << row_name;  // pp alone
      EXPECT_EQ(pp->pipeline_ranks(row.ranks(c)), 4) << row_name;
      EXPECT_EQ(pp->microbatches(c), c.pp_microbatches) << row_name;
      EXPECT_EQ(row.ranks(c), 4) << row_name;            // not --ranks
      EXPECT_EQ(row.samples_per_step(c), 16) << row_name;  // one shared batch
      EXPECT_FALSE(row.standard) << row_name;              // 4 processes: on request only
      EXPECT_THAT(row.note(c), HasSubstr("8 blocks")) << row_name;
    }
    EXPECT_FALSE(find_row_spec(name).torch());
    EXPECT_STREQ(find_row_spec("torch_" + name).script, "torch_pipeline_baseline.py");
  }
  EXPECT_EQ(pipeline_row(find_row_spec("tp")), nullptr);
  EXPECT_EQ(pipeline_row(find_row_spec("torch_ddp")), nullptr);
}

TEST(PipelineRows, DpTimesPpRowAndItsTorchTwinAreTwoReplicasOfATwoStagePipeline) {
  BenchConfig c;
  c.ranks = 2;
  c.batch = 16;
  c.pp_microbatches = 8;
  for (const std::string row_name : {"dp2_pp2", "torch_dp2_pp2"}) {
    const Row& row = find_row_spec(row_name);
    const PipelineRow* pp = pipeline_row(row);
    ASSERT_NE(pp, nullptr) << row_name;
    EXPECT_STREQ(pp->schedule, "1f1b") << row_name;
    EXPECT_EQ(pp->stages_per_rank, 1) << row_name;
    EXPECT_EQ(pp->data_parallel, 2) << row_name;
    EXPECT_EQ(row.ranks(c), 4) << row_name;  // a (dp, pp) = (2, 2) mesh, not --ranks
    EXPECT_EQ(pp->pipeline_ranks(row.ranks(c)), 2) << row_name;
    // Each replica: half of the batch in half of the micro-batches, each of
    // the pp4 rows' size (batch / pp_microbatches = 2 samples).
    EXPECT_EQ(pp->microbatches(c), 4) << row_name;
    EXPECT_EQ(row.samples_per_step(c), 16) << row_name;  // the replicas' halves together
    EXPECT_FALSE(row.standard) << row_name;              // 4 processes: on request only
    EXPECT_TRUE(row.communicates) << row_name;
    EXPECT_THAT(row.note(c), HasSubstr("(dp, pp) = (2, 2)")) << row_name;
    EXPECT_THAT(row.note(c), HasSubstr("4 micro-batches")) << row_name;
  }
  EXPECT_FALSE(find_row_spec("dp2_pp2").torch());
  EXPECT_STREQ(find_row_spec("torch_dp2_pp2").script, "torch_pipeline_baseline.py");
  // pp4's note now points at the dp x pp row.
  EXPECT_THAT(find_row_spec("pp4").note(c), HasSubstr("dp2_pp2"));
}

TEST(PipelineRows, TheWorkersAreToldTheLayersMicroBatchesAndSplit) {
  BenchConfig c;
  c.pp_layers = 12;
  c.pp_microbatches = 4;
  c.pp_split = "balanced";
  const std::vector<std::string> args = c.worker_args();
  auto value_of = [&](const std::string& flag) {
    for (size_t i = 0; i + 1 < args.size(); ++i)
      if (args[i] == flag) return args[i + 1];
    return std::string("(absent)");
  };
  EXPECT_EQ(value_of("--pp-layers"), "12");
  EXPECT_EQ(value_of("--pp-microbatches"), "4");
  EXPECT_EQ(value_of("--pp-split"), "balanced");
  EXPECT_EQ(BenchConfig{}.pp_split, "even");  // equal stages, as the bubble formulas assume
  EXPECT_EQ(BenchConfig{}.pp_layers, 8);  // the targets' 8-block GPT
  EXPECT_EQ(BenchConfig{}.pp_microbatches, 8);
}

TEST(PipelineBubble, IsTheStepsMeanShareOutsideComputeThenTheRanksMean) {
  // Rank 0: 1 of 2 s, 1 of 4 s idle -> (0.5 + 0.75) / 2; rank 1: (0.25 + 0.5) / 2.
  const MeasuredBubble b = measured_bubble({{1, 1}, {3, 1}}, {{2, 4}, {4, 2}});
  ASSERT_EQ(b.each_rank.size(), 2u);
  EXPECT_DOUBLE_EQ(b.each_rank[0], 0.625);
  EXPECT_DOUBLE_EQ(b.each_rank[1], 0.375);
  EXPECT_DOUBLE_EQ(b.mean, 0.5);
  EXPECT_DOUBLE_EQ(measured_bubble({{0}}, {{0}}).mean, 1.0);  // an empty step is all bubble
  EXPECT_THROW(measured_bubble({{1, 1}}, {{2}}), ArgumentError);
  EXPECT_THROW(measured_bubble({{1}}, {{2}, {2}}), ArgumentError);
  EXPECT_THROW(measured_bubble({}, {}), ArgumentError);
}

// One round of a pipeline row's result line (ours: with hp::pp's figures).
json pipeline_run(const std::string& row, double compute, bool ours) {
  json run = {{"row", row},
              {"ranks", 4},
              {"step_times_s", {0.5, 0.4, 0.6}},
              {"losses", {6.0, 5.9, 5.8}},
              {"first_loss", 6.1},
              {"peak_rss_delta_bytes_per_rank", {10, 20, 30, 40}},
              {"kernel_s_per_step_per_rank", {0.1, 0.1, 0.1, 0.1}},
              {"page_faults_per_step_per_rank", {1, 1, 1, 1}},
              {"host_s_per_step_per_rank", {0.5, 0.5, 0.5, 0.5}},
              {"units", 9},
              {"device", "cpu"}};
  json pipeline = {{"schedule", "1f1b"},
                   {"stages_per_rank", 1},
                   {"microbatches", 8},
                   {"layers", 8},
                   {"bubble_method", "how"}};
  const std::vector<double> steps = {0.4, 0.4, 0.4};
  const std::vector<double> computes = {compute, compute, compute};
  pipeline["compute_s_per_rank_per_step"] = {computes, computes, computes, computes};
  pipeline["step_s_per_rank_per_step"] = {steps, steps, steps, steps};
  if (ours) {
    pipeline["theoretical_bubble"] = 3.0 / 11;
    pipeline["simulated_bubble"] = 3.0 / 11;
    run["mesh"] = {4};
    run["mesh_names"] = {"pp"};
    run["comm_fusion"] = false;
    run["prefetch"] = false;
    run["parameters"] = 100;
    run["block_param_bytes"] = 10;
    run["end_bytes_per_rank"] = {1, 1, 1, 1};
    run["peak_bytes_per_rank"] = {5, 6, 7, 8};
    json counts = json::object();
    for (const char* kind :
         {"all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier"})
      counts[kind] = 0;
    run["collective_counts_per_rank"] = {counts, counts, counts, counts};
    run["comm_seconds_per_rank"] = {0, 0, 0, 0};
    run["wait_seconds_per_rank"] = {0, 0, 0, 0};
  } else {
    run["collectives"] = {{"all_gather_per_step", 0},
                          {"reduce_scatter_per_step", 0},
                          {"all_reduce_per_step", 0},
                          {"method", "none"}};
  }
  run["pipeline"] = pipeline;
  return run;
}

TEST(PipelineSummary, ReportsTheMeasuredBubbleBesideTheSchedulesOwn) {
  BenchConfig c;
  json first = pipeline_run("pp4", 0.3, true), second = pipeline_run("pp4", 0.2, true);
  first["round"] = 0;
  second["round"] = 1;
  const json row = summarize_row(find_row_spec("pp4"), {first, second}, c);
  const json& p = row["pipeline"];
  EXPECT_EQ(p["schedule"], "1f1b");
  EXPECT_DOUBLE_EQ(p["measured_bubble_per_round"][0].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(p["measured_bubble_per_round"][1].get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(p["measured_bubble"].get<double>(), 0.375);
  EXPECT_EQ(p["measured_bubble_each_rank"].size(), 4u);
  EXPECT_DOUBLE_EQ(p["theoretical_bubble"].get<double>(), 3.0 / 11);
  EXPECT_EQ(row["peak_bytes_per_rank"], 8);  // libtorch's allocator, the highest rank
  EXPECT_EQ(p["data_parallel"], 1);           // absent from the worker's: pp alone
  EXPECT_DOUBLE_EQ(row["tokens_per_s"].get<double>(), c.batch * c.seq / 0.5);

  const json theirs =
      summarize_row(find_row_spec("torch_pp4"), {pipeline_run("torch_pp4", 0.1, false)}, c);
  EXPECT_DOUBLE_EQ(theirs["pipeline"]["measured_bubble"].get<double>(), 0.75);
  EXPECT_TRUE(theirs["pipeline"]["theoretical_bubble"].is_null());  // hp::pp's figure, ours only
  EXPECT_EQ(theirs["peak_bytes_per_rank"], 40);  // the RSS delta, as the other PyTorch rows
}

TEST(PipelineSummary, CarriesTheDataParallelDegreeAndTheSplitOfDpTimesPp) {
  json run = pipeline_run("dp2_pp2", 0.3, true);
  run["round"] = 0;
  run["pipeline"]["data_parallel"] = 2;
  run["pipeline"]["microbatches"] = 4;
  run["pipeline"]["split"] = "even";
  const json row = summarize_row(find_row_spec("dp2_pp2"), {run}, BenchConfig{});
  EXPECT_EQ(row["pipeline"]["data_parallel"], 2);
  EXPECT_EQ(row["pipeline"]["split"], "even");
  EXPECT_EQ(row["pipeline"]["microbatches"], 4);
  EXPECT_DOUBLE_EQ(row["pipeline"]["measured_bubble"].get<double>(), 0.25);
  EXPECT_EQ(row["peak_bytes_each_rank"], json({5, 6, 7, 8}));  // every rank's peak
}

TEST(PipelineTargets, DpTimesPpIsOursOverPyTorchsFsdp2WithPipelining) {
  const json rows = json::array({{{"name", "dp2_pp2"}, {"step_time_s_median", 0.4}},
                                 {{"name", "torch_dp2_pp2"}, {"step_time_s_median", 0.5}}});
  const json targets = compute_targets(rows, BenchConfig{});
  const json& t = targets["dp2_pp2_over_torch_dp2_pp2"];
  EXPECT_DOUBLE_EQ(t["value"].get<double>(), 0.8);
  EXPECT_EQ(t["pass"], true);
  EXPECT_DOUBLE_EQ(t["limit"].get<double>(), 1.0);
}

TEST(PipelineTargets, EachScheduleIsOursOverItsTorchTwin) {
  const json rows = json::array({{{"name", "pp4_zero_bubble"}, {"step_time_s_median", 0.3}},
                                 {{"name", "torch_pp4_zero_bubble"}, {"step_time_s_median", 0.6}}});
  const json targets = compute_targets(rows, BenchConfig{});
  const json& t = targets["pp4_zero_bubble_over_torch_pp4_zero_bubble"];
  EXPECT_DOUBLE_EQ(t["value"].get<double>(), 0.5);
  EXPECT_EQ(t["pass"], true);
  EXPECT_DOUBLE_EQ(t["limit"].get<double>(), 0.8);
  for (const char* key : {"pp4_over_torch_pp4", "pp4_gpipe_over_torch_pp4_gpipe",
                          "pp4_interleaved_over_torch_pp4_interleaved"})
    EXPECT_TRUE(targets[key]["value"].is_null()) << key;  // their rows did not run
}

// A pipeline row as the report holds it: its measured and theoretical
// bubble and every rank's peak.
json pipeline_row(const std::string& name, double measured, std::vector<double> peaks) {
  return {{"name", name},
          {"step_time_s_median", 0.4},
          {"peak_bytes_each_rank", peaks},
          {"pipeline", {{"measured_bubble", measured}, {"theoretical_bubble", 0.25}}}};
}

TEST(PipelineTargets, BubblesAreJudgedAgainstTheTheoryAnd1F1BAndPeaksAgainstGPipeRankByRank) {
  BenchConfig c;
  c.batch = 32;
  const json rows = json::array({pipeline_row("pp4", 0.29, {60, 50, 40, 30}),
                                 pipeline_row("pp4_gpipe", 0.31, {90, 90, 90, 95}),
                                 pipeline_row("pp4_interleaved", 0.22, {}),
                                 pipeline_row("pp4_zero_bubble", 0.30, {})});
  const json targets = compute_targets(rows, c);
  const json& bubble = targets["pp4_bubble_over_theory"];
  EXPECT_DOUBLE_EQ(bubble["value"].get<double>(), 0.29 / 0.25);
  EXPECT_EQ(bubble["pass"], true);  // 1.16 <= 1.2
  EXPECT_EQ(bubble["stated_configuration"], true);
  EXPECT_EQ(bubble["samples_per_microbatch"], 4);
  EXPECT_EQ(targets["pp4_interleaved_bubble_over_pp4"]["pass"], true);
  EXPECT_EQ(targets["pp4_zero_bubble_bubble_over_pp4"]["pass"], false);  // 0.30 > 0.29
  // Rank 0 decides: 60 / 90 = 2/3 passes, the others are lower.
  const json& peak = targets["pp4_peak_over_pp4_gpipe"];
  EXPECT_DOUBLE_EQ(peak["value"].get<double>(), 60.0 / 90);
  EXPECT_EQ(peak["pass"], true);
  ASSERT_EQ(peak["each_rank"].size(), 4u);
  EXPECT_DOUBLE_EQ(peak["each_rank"][3].get<double>(), 30.0 / 95);

  json worse = rows;
  worse[0] = pipeline_row("pp4", 0.31, {61, 50, 40, 30});
  const json failed = compute_targets(worse, c);
  EXPECT_EQ(failed["pp4_bubble_over_theory"]["pass"], false);  // 1.24 > 1.2
  EXPECT_EQ(failed["pp4_peak_over_pp4_gpipe"]["pass"], false);  // 61 / 90 > 2/3
  c.pp_microbatches = 4;
  EXPECT_EQ(compute_targets(rows, c)["pp4_bubble_over_theory"]["stated_configuration"], false);
  // Without GPipe's row the peak target is unmeasured, not passed.
  EXPECT_TRUE(compute_targets(json::array({rows[0]}), c)["pp4_peak_over_pp4_gpipe"]["pass"]
                  .is_null());
}

}  // namespace
}  // namespace hp::bench
