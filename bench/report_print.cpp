#include "bench/report_print.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "bench/rows.h"
#include "bench/targets.h"

namespace hp::bench {

using json = nlohmann::json;

namespace {

// One measured row of the table.
void print_row(const json& r) {
  const std::string name = r["name"];
  const json& c = r["collectives_per_step"];
  const std::string exposed =
      r["exposed_comm_fraction"].is_null()
          ? "-"
          : fmt::format("{:.1f}%", 100 * r["exposed_comm_fraction"].get<double>());
  const std::string loss =
      r["last_loss"].is_null() ? "-" : fmt::format("{:.4f}", r["last_loss"].get<double>());
  const std::string plan =
      r.contains("predicted_peak_bytes_per_rank")
          ? fmt::format("{:.1f}", r["predicted_peak_bytes_per_rank"].get<double>() / (1 << 20))
          : "-";
  auto figure = [&](const char* key) {
    return r.value(key, json(nullptr)).is_null() ? std::string("-")
                                                 : fmt::format("{:.1f}", r[key].get<double>());
  };
  const std::string method = r.value("peak_bytes_method", std::string());
  const std::string host_ms =
      r.value("host_ms_per_unit_step", json(nullptr)).is_null()
          ? "-"
          : fmt::format("{:.3f}", r["host_ms_per_unit_step"].get<double>());
  fmt::print(
      "{:<20} {:>5} {:>10.4f} {:>9.0f} {:>10.1f} {:>9} {:>10.1f} {:>6.1f} {:>6.1f} "
      "{:>6.1f} {:>8} {:>7} {:>7} {:>8} {:>8}{}{}\n",
      name, r["ranks"].get<int>(), r["step_time_s_median"].get<double>(),
      r["tokens_per_s"].get<double>(), r["peak_bytes_per_rank"].get<double>() / (1 << 20), plan,
      c["total"].get<double>(), c["all_gather"].get<double>(), c["reduce_scatter"].get<double>(),
      c["all_reduce"].get<double>(), exposed, figure("kernel_ms_per_step"),
      figure("page_faults_per_step"), host_ms, loss,
      method.rfind("rss_delta", 0) == 0 ? "  (peak: RSS delta)" : "",
      r.contains("failed_rounds") ? "  [a round failed]" : "");
}

void print_rows(const json& rows) {
  fmt::print(
      "\n{:<20} {:>5} {:>10} {:>9} {:>10} {:>9} {:>10} {:>6} {:>6} {:>6} {:>8} {:>7} "
      "{:>7} {:>8} {:>8}\n",
      "row", "ranks", "step_s", "tok/s", "peak_MiB", "plan_MiB", "coll/step", "AG", "RS", "AR",
      "exposed", "sys_ms", "faults", "host_ms/u", "loss");
  for (const auto& r : rows) {
    const std::string name = r["name"];
    if (r.contains("skipped")) {
      fmt::print("{:<20} {:>5}  skipped: {}\n", name, r["ranks"].get<int>(),
                 r["skipped"].get<std::string>());
    } else if (r.contains("error")) {
      const std::string error = r["error"];
      fmt::print("{:<20} {:>5}  FAILED: {}\n", name, r["ranks"].get<int>(),
                 error.substr(0, std::min(error.find('\n'), size_t{70})));
    } else {
      print_row(r);
    }
  }
}

// The pipeline rows: each schedule's step time, measured bubble and peak
// (the highest rank's, then every rank's) beside PyTorch's twin, with the
// schedule's theoretical and simulated bubble; dp > 1: replicas of the
// pipeline (dp2_pp2), m micro-batches per replica.
void print_pipeline(const json& rows) {
  auto percent = [](const json& v) {
    return v.is_null() ? std::string("-") : fmt::format("{:.1f}%", 100 * v.get<double>());
  };
  bool header = false;
  for (const auto& r : rows) {
    if (!r.contains("pipeline") || r["step_time_s_median"].is_null()) continue;
    if (!header) {
      fmt::print("\npipeline rows (bubble: share of each rank's pipeline step outside compute "
                 "actions, mean over ranks and steps):\n{:<24} {:<12} {:>3} {:>3} {:>3} {:>10} "
                 "{:>10} {:>10} {:>10} {:>10}  {}\n",
                 "row", "schedule", "dp", "v", "m", "step_s", "measured", "theory", "simulated",
                 "peak_MiB", "each rank MiB: peak (the step's own)");
      header = true;
    }
    const json& p = r["pipeline"];
    // Per rank, the peak and what the step holds above the state kept
    // between steps (parameters, gradients, AdamW's moments: the memory at
    // the end of the last step), which is all the schedules differ in.
    std::string each;
    const json peaks = r.value("peak_bytes_each_rank", json::array());
    const json ends = r.value("end_bytes_per_rank", json::array());
    for (size_t i = 0; i < peaks.size(); ++i) {
      const double peak = peaks[i].get<double>() / (1 << 20);
      each += fmt::format("{}{:.1f}", each.empty() ? "" : " ", peak);
      if (ends.is_array() && i < ends.size())
        each += fmt::format(" ({:.1f})", peak - ends[i].get<double>() / (1 << 20));
    }
    fmt::print("{:<24} {:<12} {:>3} {:>3} {:>3} {:>10.4f} {:>10} {:>10} {:>10} {:>10.1f}  {}\n",
               r["name"].get<std::string>(), p["schedule"].get<std::string>(),
               p.value("data_parallel", 1), p["stages_per_rank"].get<int>(),
               p["microbatches"].get<int>(),
               r["step_time_s_median"].get<double>(), percent(p["measured_bubble"]),
               percent(p.value("theoretical_bubble", json(nullptr))),
               percent(p.value("simulated_bubble", json(nullptr))),
               r["peak_bytes_per_rank"].get<double>() / (1 << 20), each);
  }
}

void print_targets(const json& targets) {
  fmt::print("\ntargets:\n");
  for (const auto& [name, t] : targets.items()) {
    fmt::print("  {}  {:<44} {:<26} limit {}{}\n", target_verdict(t), name, target_value(t),
               t["limit"].dump(),
               t.value("conclusive", true) ? "" : "  (not every round agrees)");
  }
}

void print_overheads(const json& h, const json& d) {
  if (h.contains("variants")) {
    fmt::print("\nhook overhead (world of 1, {} tiny units): plain {:.1f} us/step\n",
               h["units"].get<int64_t>(), h["plain_step_us"].get<double>());
    for (const auto& [name, v] : h["variants"].items()) {
      fmt::print("  {:<26} {:>9.1f} us/step  {:>+8.2f} us per unit per step\n", name,
                 v["step_us"].get<double>(), v["overhead_us_per_unit_per_step"].get<double>());
    }
  } else if (h.contains("error")) {
    fmt::print("\nhook overhead FAILED\n");
  }
  if (d.contains("overhead_us_per_op")) {
    fmt::print("\nDTensor op dispatch ({} ranks, 8-element tensors, no communication), extra "
               "time per op over the local op:\n",
               d["world_size"].get<int64_t>());
    for (const auto& [name, v] : d["overhead_us_per_op"].items()) {
      fmt::print("  {:<26} {:>+8.2f} us\n", name, v.get<double>());
    }
  } else if (d.contains("error")) {
    fmt::print("\nDTensor op dispatch FAILED\n");
  }
}

}  // namespace

void print_report(const json& report) {
  print_rows(report["rows"]);
  print_pipeline(report["rows"]);
  print_targets(report["targets"]);
  print_overheads(report["hook_overhead"], report["dispatch_overhead"]);
  std::fflush(stdout);
}

void print_checkpoint(const json& c) {
  const json& b = c["best"];
  fmt::print("\ncheckpoint ({:.1f}M parameters + AdamW, {:.2f} GB, {} ranks, {} on {}):\n"
             "  save {:.2f} GB/s vs plain write {:.2f} GB/s ({:.2f}x)\n"
             "  load {:.2f} GB/s vs plain read  {:.2f} GB/s ({:.2f}x)\n"
             "  peak extra memory during save: {:.1f} MiB per rank\n",
             c["parameters"].get<double>() / 1e6,
             c["repeats"][0]["checkpoint_bytes"].get<double>() / 1e9, c["ranks"].get<int>(),
             c["directory"].get<std::string>(), c["filesystem"].get<std::string>(),
             b["save_gb_per_s"].get<double>(), b["plain_write_gb_per_s"].get<double>(),
             b["save_gb_per_s"].get<double>() / b["plain_write_gb_per_s"].get<double>(),
             b["load_gb_per_s"].get<double>(), b["plain_read_gb_per_s"].get<double>(),
             b["load_gb_per_s"].get<double>() / b["plain_read_gb_per_s"].get<double>(),
             b["peak_extra_bytes_during_save_per_rank"].get<double>() / (1 << 20));
  const json& t = c["training"];
  const json& stall = c["targets"]["async_stall_vs_sync"];
  const json& overlap = c["targets"]["overlapping_step_vs_without_save"];
  fmt::print(
      "  in training ({} tokens per rank per step): stall per save sync {:.3f} s, async {:.3f} s "
      "({:.3f}x, target <= {}x: {})\n"
      "  step time without a save {:.3f} s, overlapping an async write {} over {} steps "
      "({}, target <= {}x: {})\n",
      t["tokens_per_rank_per_step"].get<int64_t>(), t["median_sync_stall_s"].get<double>(),
      t["median_async_stall_s"].get<double>(), stall["ratio"].get<double>(),
      stall["limit"].get<double>(), target_verdict(stall),
      t["median_step_without_save_s"].get<double>(),
      // null when no step overlapped a write (the median of none)
      t["median_step_overlapping_write_s"].is_null()
          ? std::string("n/a")
          : fmt::format("{:.3f} s", t["median_step_overlapping_write_s"].get<double>()),
      t["overlapping_steps"].get<int64_t>(),
      overlap["ratio"].is_null() ? std::string("n/a")
                                 : fmt::format("{:.2f}x", overlap["ratio"].get<double>()),
      overlap["limit"].get<double>(), target_verdict(overlap));
  std::fflush(stdout);
}

}  // namespace hp::bench
