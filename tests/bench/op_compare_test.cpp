// hp-bench --profile-ops's comparison (A2): ops paired by name, sorted by
// the difference of self time per step, totals, and the directory scan,
// on hand-made profiles.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "bench/op_compare.h"
#include "hp/util/error.h"

namespace hp::bench {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

json op(const std::string& name, double count, double self_us) {
  return {{"name", name}, {"count", count}, {"self_cpu_time", self_us},
          {"cpu_time_total", self_us}};
}

json profile(std::vector<json> ops) { return {{"time_unit", "us"}, {"ops", ops}}; }

TEST(OpCompare, PairsByNameAndSortsByAbsoluteDifference) {
  const json ours = profile({op("aten::mm", 4, 1000), op("aten::add", 10, 500),
                             op("hp_only", 1, 50)});
  const json theirs = profile({op("aten::mm", 4, 1200), op("aten::add", 8, 100),
                               op("torch_only", 2, 800)});
  const OpComparison c = compare_ops("single", ours, "torch_single", theirs);
  ASSERT_EQ(c.ops.size(), 4u);
  // |diffs| in ms: torch_only 0.8, aten::add 0.4, aten::mm 0.2, hp_only 0.05.
  EXPECT_EQ(c.ops[0].name, "torch_only");
  EXPECT_DOUBLE_EQ(c.ops[0].diff_ms(), -0.8);
  EXPECT_EQ(c.ops[0].ours_calls, 0);
  EXPECT_EQ(c.ops[0].torch_calls, 2);
  EXPECT_EQ(c.ops[1].name, "aten::add");
  EXPECT_DOUBLE_EQ(c.ops[1].diff_ms(), 0.4);
  EXPECT_EQ(c.ops[1].ours_calls, 10);
  EXPECT_EQ(c.ops[1].torch_calls, 8);
  EXPECT_EQ(c.ops[2].name, "aten::mm");
  EXPECT_EQ(c.ops[3].name, "hp_only");
  EXPECT_DOUBLE_EQ(c.totals.ours_self_ms, 1.55);
  EXPECT_DOUBLE_EQ(c.totals.torch_self_ms, 2.1);
  EXPECT_EQ(c.totals.ours_calls, 15);
  EXPECT_EQ(c.totals.torch_calls, 14);
  EXPECT_EQ(c.ours_wall_ms, -1);  // no wall_us in these profiles
  EXPECT_EQ(c.ours_allocations, -1);

  const std::string text = format_comparison(c, 2);
  EXPECT_THAT(text, HasSubstr("single vs torch_single"));
  EXPECT_THAT(text, HasSubstr("torch_only"));
  EXPECT_THAT(text, HasSubstr("(2 more ops)"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("hp_only")));
  EXPECT_THAT(text, HasSubstr("total"));

  json counted = ours;
  counted["allocations"] = 6;
  const OpComparison with_allocations = compare_ops("single", counted, "torch_single", theirs);
  EXPECT_EQ(with_allocations.ours_allocations, 6);
  EXPECT_THAT(format_comparison(with_allocations), HasSubstr("our CPU allocations per step: 6.0"));
}

TEST(OpCompare, RefusesAProfileWithoutOps) {
  EXPECT_THAT([] { compare_ops("single", json::object(), "torch_single", profile({})); },
              ::testing::ThrowsMessage<ArgumentError>(HasSubstr("op profile of single")));
  const json bad = profile({json{{"name", "aten::mm"}}});
  EXPECT_THAT([&] { compare_ops("single", profile({}), "torch_single", bad); },
              ::testing::ThrowsMessage<ArgumentError>(HasSubstr("lacks a name, a count")));
}

TEST(OpCompare, DirectoryComparesEveryPairWhoseFilesExist) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "hp-op-compare-test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto write = [&](const std::string& row, const json& j) {
    std::ofstream(ops_file(dir.string(), row, 0)) << j.dump();
  };
  EXPECT_EQ(compare_profile_dir(dir.string()), "");
  write("single", profile({op("aten::mm", 1, 10)}));
  write("torch_single", profile({op("aten::mm", 1, 20)}));
  write("ddp", profile({op("aten::mm", 1, 10)}));  // torch_ddp missing: left out
  const std::string text = compare_profile_dir(dir.string());
  EXPECT_THAT(text, HasSubstr("single vs torch_single"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("ddp vs torch_ddp")));
  EXPECT_EQ(ops_file("d", "single", 1), "d/single.rank1.ops.json");
  std::filesystem::remove_all(dir);
}

TEST(OpCompare, MergesProfilesWeightedBySteps) {
  json a = profile({op("aten::mm", 1, 10)});
  a["steps"] = 2;
  a["wall_us"] = 100;
  a["allocations"] = nullptr;
  json b = profile({op("aten::mm", 4, 40), op("aten::add", 3, 30)});
  b["steps"] = 1;
  b["wall_us"] = 400;
  b["allocations"] = 5;
  const json m = merge_per_step(a, b);
  EXPECT_EQ(m["steps"], 3);
  EXPECT_DOUBLE_EQ(m["wall_us"].get<double>(), 200);  // (2 * 100 + 400) / 3
  EXPECT_TRUE(m["allocations"].is_null());           // a did not count them
  ASSERT_EQ(m["ops"].size(), 2u);
  EXPECT_EQ(m["ops"][0]["name"], "aten::mm");         // by self time
  EXPECT_DOUBLE_EQ(m["ops"][0]["count"].get<double>(), 2);           // (2 * 1 + 4) / 3
  EXPECT_DOUBLE_EQ(m["ops"][0]["self_cpu_time"].get<double>(), 20);  // (2 * 10 + 40) / 3
  EXPECT_DOUBLE_EQ(m["ops"][1]["count"].get<double>(), 1);           // (0 + 3) / 3
  EXPECT_DOUBLE_EQ(m["ops"][1]["self_cpu_time"].get<double>(), 10);
  a.erase("steps");
  EXPECT_THAT([&] { merge_per_step(a, b); },
              ::testing::ThrowsMessage<ArgumentError>(HasSubstr("\"steps\"")));
}

TEST(OpCompare, WritesPerStepFilesOfTheSameSchema) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "hp-op-file-test";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  OpProfileResult total;
  total.wall_us = 200;
  total.ops = {OpStats{"aten::mm", 4, 100, 150, 0}};
  write_ops_file(dir.string(), "ddp", 1, 2, total);
  std::ifstream in(ops_file(dir.string(), "ddp", 1));
  const json j = json::parse(in);
  EXPECT_EQ(j["row"], "ddp");
  EXPECT_EQ(j["rank"], 1);
  EXPECT_EQ(j["steps"], 2);
  EXPECT_EQ(j["source"], "hp");
  EXPECT_EQ(j["wall_us"], 100.0);
  EXPECT_EQ(j["ops"][0]["count"], 2.0);
  EXPECT_EQ(j["ops"][0]["self_cpu_time"], 50.0);
  EXPECT_EQ(j["ops"][0]["cpu_time_total"], 75.0);
  // The comparison reads what was written.
  EXPECT_EQ(compare_ops("ddp", j, "torch_ddp", j).totals.diff_ms(), 0);
  EXPECT_EQ(compare_ops("ddp", j, "torch_ddp", j).ours_wall_ms, 0.1);
  EXPECT_EQ(compare_ops("ddp", j, "torch_ddp", j).ours_allocations, -1);  // not counted
  // A second round of the same row adds its steps to the file.
  total.ops = {OpStats{"aten::mm", 2, 20, 30, 0}};
  write_ops_file(dir.string(), "ddp", 1, 2, total);
  std::ifstream again(ops_file(dir.string(), "ddp", 1));
  const json both = json::parse(again);
  EXPECT_EQ(both["steps"], 4);
  EXPECT_DOUBLE_EQ(both["ops"][0]["count"].get<double>(), 1.5);          // (4 + 2) / 4
  EXPECT_DOUBLE_EQ(both["ops"][0]["self_cpu_time"].get<double>(), 30.0);  // (100 + 20) / 4
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace hp::bench
