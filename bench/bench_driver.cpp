#include "bench/bench_driver.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <thread>
#include <torch/version.h>

#include "bench/median.h"
#include "tools/common/subprocess.h"

#ifndef HP_BENCH_SOURCE_DIR
#define HP_BENCH_SOURCE_DIR "bench"
#endif

namespace hp::bench {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;

std::string self_path() {
  std::error_code ec;
  const fs::path p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot read /proc/self/exe: " + ec.message());
  return p.string();
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

int row_ranks(const std::string& row, const BenchConfig& c) {
  if (row == "single") return 1;
  if (row == "hsdp_fused_prefetch") return c.hsdp_ranks;
  // A (dp, tp) mesh of 2 x 2.
  if (row == "fsdp_tp") return 4;
  return c.ranks;
}

std::string hsdp_note(const BenchConfig& c) {
  if (c.hsdp_ranks == 2) {
    return "degenerate HSDP: 2 ranks give the mesh [1, 2] (replicate 1 x shard 2), so the "
           "replicate all-reduce has a group of one and moves nothing; the row measures the "
           "2-D HSDP code path at the same per-rank work as fsdp_fused_prefetch, not "
           "cross-replica traffic. Run with --hsdp-ranks 4 for a real [2, 2] mesh.";
  }
  return "HSDP on [" + std::to_string(c.hsdp_ranks / 2) + ", 2] with " +
         std::to_string(c.hsdp_ranks) +
         " ranks: more processes than this machine may have cores, so its step time is "
         "oversubscribed and does not compare with the 2-rank rows; tokens_per_s counts all " +
         std::to_string(c.hsdp_ranks) + " ranks' tokens.";
}

// Tokens every row trains on: uniform ids from a fixed seed (the content does
// not matter to a step's cost; that every row sees the same does).
void write_tokens(const std::string& path, const BenchConfig& c, int max_ranks) {
  const int64_t needed = (c.warmup + c.steps) * c.batch * max_ranks * c.seq + c.seq + 2;
  const int64_t count = std::max<int64_t>(needed, 1 << 17);
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<int64_t> dist(0, c.vocab - 1);
  std::string bytes(static_cast<size_t>(count) * 2, '\0');
  for (int64_t i = 0; i < count; ++i) {
    const auto t = static_cast<uint16_t>(dist(rng));
    bytes[2 * i] = static_cast<char>(t & 0xff);
    bytes[2 * i + 1] = static_cast<char>(t >> 8);
  }
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write the token file " + path);
}

struct RunOutcome {
  bool ok = false;
  json result;
  std::string error;
  double wall_s = 0;
};

// "a b 'c d'" for logs.
std::string shell_words(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    if (!out.empty()) out += ' ';
    const bool plain = !a.empty() && a.find_first_of(" \t\n'\"\\$`*?;&|<>()") == std::string::npos;
    if (plain) {
      out += a;
    } else {
      out += '\'';
      for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
  }
  return out;
}

// Runs argv to completion, its stdout and stderr merged into one stream of
// lines, each passed to on_line as it arrives. The rows bound their own
// time (hprun --timeout), so the driver sets no limit of its own.
struct ChildOutcome {
  tools::ProcessResult result;
  std::vector<std::string> lines;
};

ChildOutcome run_child(const std::vector<std::string>& argv,
                       std::function<void(const std::string&)> on_line) {
  ChildOutcome child;
  tools::ProcessOptions options;
  options.merge_stderr = true;
  options.on_line = [&](const std::string& line) {
    child.lines.push_back(line);
    if (on_line) on_line(line);
  };
  tools::RunningProcess process(argv, options);
  child.result = process.wait(tools::kNoTimeLimit);
  return child;
}

RunOutcome launch(const std::string& label, const std::vector<std::string>& argv, bool verbose) {
  RunOutcome outcome;
  std::cerr << "[hp-bench] " << label << ": " << shell_words(argv) << std::endl;
  const auto t0 = Clock::now();
  ChildOutcome child;
  try {
    child = run_child(argv, [&](const std::string& line) {
      if (verbose) std::cerr << "  | " << line << "\n";
    });
  } catch (const std::exception& e) {
    outcome.error = e.what();
    return outcome;
  }
  outcome.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::string marker = kResultMarker;
  for (auto it = child.lines.rbegin(); it != child.lines.rend(); ++it) {
    const size_t pos = it->find(marker);
    if (pos == std::string::npos) continue;
    try {
      outcome.result = json::parse(it->substr(pos + marker.size()));
    } catch (const std::exception& e) {
      outcome.error = std::string("unreadable result line: ") + e.what();
    }
    break;
  }
  const int status = tools::shell_status(child.result);
  const std::string how = tools::describe_exit(child.result);
  if (status != 0 || outcome.result.is_null()) {
    std::string tail;
    const size_t from = child.lines.size() > 15 ? child.lines.size() - 15 : 0;
    for (size_t i = from; i < child.lines.size(); ++i) tail += child.lines[i] + "\n";
    outcome.error = (status != 0 ? how : std::string("no result line")) +
                    (outcome.error.empty() ? "" : "; " + outcome.error) + "; last output:\n" +
                    tail;
    outcome.result = json();
    std::cerr << "[hp-bench] " << label << " FAILED (" << how << ")\n" << tail;
    return outcome;
  }
  outcome.ok = true;
  return outcome;
}

// Pools the rounds of one row into the row of the report.
json summarize(const std::string& name, const std::vector<json>& runs, const BenchConfig& c,
               int ranks) {
  json row;
  row["name"] = name;
  row["ranks"] = ranks;
  std::vector<double> times;
  for (const auto& r : runs) {
    for (double t : r["step_times_s"]) times.push_back(t);
  }
  const double med = median(times);
  row["step_time_s_median"] = number_or_null(med);
  row["step_time_s_p10"] = number_or_null(quantile(times, 0.1));
  row["step_time_s_p90"] = number_or_null(quantile(times, 0.9));
  row["steps_timed"] = times.size();
  row["rounds"] = runs.size();
  // Data-parallel rows take a batch per rank; tensor parallelism's ranks
  // share one.
  const int64_t samples = name == "tp"        ? c.batch
                          : name == "fsdp_tp" ? ranks / 2 * c.batch
                                              : ranks * c.batch;
  row["tokens_per_s"] = number_or_null(static_cast<double>(samples * c.seq) / med);
  const json& last = runs.back();
  row["first_loss"] = last.value("first_loss", json(nullptr));
  row["last_loss"] = last["losses"].empty() ? json(nullptr) : last["losses"].back();

  const bool torch_row = name.rfind("torch_", 0) == 0;
  // Memory: the highest rank over every round.
  auto max_over = [&](const char* key) {
    std::vector<int64_t> each;
    for (const auto& r : runs) {
      const auto v = r[key].get<std::vector<int64_t>>();
      if (each.size() < v.size()) each.resize(v.size(), 0);
      for (size_t i = 0; i < v.size(); ++i) each[i] = std::max(each[i], v[i]);
    }
    return each;
  };
  const std::vector<int64_t> rss = max_over("peak_rss_delta_bytes_per_rank");
  row["peak_rss_delta_bytes_per_rank"] = *std::max_element(rss.begin(), rss.end());
  if (torch_row) {
    row["peak_bytes_per_rank"] = row["peak_rss_delta_bytes_per_rank"];
    row["peak_bytes_method"] =
        "rss_delta: getrusage ru_maxrss after the timed steps minus VmRSS before the model was "
        "built (whole process, includes allocator caching and fragmentation; PyTorch has no "
        "counting CPU allocator)";
    row["peak_bytes_each_rank"] = rss;
  } else {
    const std::vector<int64_t> peaks = max_over("peak_bytes_per_rank");
    row["peak_bytes_per_rank"] = *std::max_element(peaks.begin(), peaks.end());
    row["peak_bytes_method"] =
        "hp::memory_stats: peak live bytes of libtorch's CPU allocator over the timed steps "
        "(tracking enabled before the model was built; excludes Gloo's own buffers)";
    row["peak_bytes_each_rank"] = peaks;
    // The memory plan's prediction for the same quantity (its steady step),
    // the highest rank, beside the measured one.
    if (last.contains("predicted_peak_bytes_per_rank")) {
      const auto predicted = last["predicted_peak_bytes_per_rank"].get<std::vector<int64_t>>();
      const auto in_flight = last["predicted_in_flight_bytes_per_rank"].get<std::vector<int64_t>>();
      const size_t top = std::max_element(predicted.begin(), predicted.end()) - predicted.begin();
      row["predicted_peak_bytes_per_rank"] = predicted[top];
      row["predicted_in_flight_bytes"] = in_flight[top];
      row["predicted_peak_each_rank"] = predicted;
      row["plan_error"] = static_cast<double>(predicted[top] - row["peak_bytes_per_rank"].get<int64_t>()) /
                          row["peak_bytes_per_rank"].get<double>();
    }
  }
  row["peak_rss_delta_method"] =
      "getrusage ru_maxrss at the end minus VmRSS before the model was built, max over ranks";

  const double steps = static_cast<double>(times.size());
  if (torch_row) {
    const json& coll = last["collectives"];
    const double ag = coll.value("all_gather_per_step", 0.0);
    const double rs = coll.value("reduce_scatter_per_step", 0.0);
    const double ar = coll.value("all_reduce_per_step", 0.0);
    row["collectives_per_step"] = {{"total", ag + rs + ar},
                                   {"all_gather", ag},
                                   {"reduce_scatter", rs},
                                   {"all_reduce", ar},
                                   {"other", 0}};
    row["collectives_method"] = coll["method"];
    row["exposed_comm_fraction"] = nullptr;
    row["exposed_comm_method"] = "not measured: c10d exposes no wait time per collective";
    row["torch_version"] = last.value("torch_version", json(nullptr));
    row["ddp"] = last.value("ddp", json(nullptr));
  } else {
    std::map<std::string, double> sum;
    double comm = 0, wait = 0;
    for (const auto& r : runs) {
      // Counts are per rank; every rank issues the same collectives. Rank 0's.
      for (const auto& [kind, v] : r["collective_counts_per_rank"][0].items()) {
        sum[kind] += v.get<double>();
      }
      for (double v : r["comm_seconds_per_rank"]) comm += v;
      for (double v : r["wait_seconds_per_rank"]) wait += v;
    }
    const double other = sum["broadcast"] + sum["all_to_all"] + sum["barrier"];
    row["collectives_per_step"] = {
        {"total", (sum["all_gather"] + sum["reduce_scatter"] + sum["all_reduce"] + other) / steps},
        {"all_gather", sum["all_gather"] / steps},
        {"reduce_scatter", sum["reduce_scatter"] / steps},
        {"all_reduce", sum["all_reduce"] / steps},
        {"other", other / steps}};
    row["collectives_method"] =
        "hp::dist::comm_stats() delta over the timed steps, rank 0 (the benchmark's own "
        "gather of results happens after)";
    const double ranks_d = static_cast<double>(ranks);
    row["comm_seconds_per_step"] = comm / steps / ranks_d;  // mean over ranks
    row["wait_seconds_per_step"] = wait / steps / ranks_d;
    if (name == "single" || comm <= 0) {
      row["exposed_comm_fraction"] = nullptr;
    } else {
      row["exposed_comm_fraction"] = wait / comm;
    }
    row["exposed_comm_method"] =
        "sum over ranks of wait_seconds (blocked in Work::wait) / sum of comm_seconds (issue to "
        "completion) over the timed steps";
    row["mesh"] = last["mesh"];
    row["mesh_names"] = last["mesh_names"];
    row["comm_fusion"] = last["comm_fusion"];
    row["prefetch"] = last["prefetch"];
    row["activation_checkpointing"] = last.value("activation_checkpointing", false);
    row["parameters"] = last["parameters"];
    row["block_param_bytes"] = last["block_param_bytes"];
    row["end_bytes_per_rank"] = last["end_bytes_per_rank"];
  }
  if (name == "hsdp_fused_prefetch") row["note"] = hsdp_note(c);
  if (name == "fsdp_tp") {
    row["note"] =
        "tensor parallel in pairs of ranks, fully_shard over the 2 pairs ((dp, tp) = (2, 2)): 4 "
        "processes, more than a 2-core machine has, so compare its tokens_per_s (both pairs' "
        "samples) rather than its step time with the 2-rank rows";
  }
  row["round_medians_s"] = json::array();
  for (const auto& r : runs) {
    row["round_medians_s"].push_back(median(r["step_times_s"].get<std::vector<double>>()));
  }
  return row;
}

const json* find_row(const json& rows, const std::string& name) {
  for (const auto& r : rows) {
    if (r["name"] == name && r.contains("step_time_s_median") && !r["step_time_s_median"].is_null()) {
      return &r;
    }
  }
  return nullptr;
}

json ratio_target(const json& rows, const std::string& a, const std::string& b, double limit,
                  const std::string& what) {
  const json* ra = find_row(rows, a);
  const json* rb = find_row(rows, b);
  json t = {{"what", what}, {"limit", limit}};
  if (!ra || !rb) {
    t["value"] = nullptr;
    t["pass"] = nullptr;
    t["missing"] = !ra ? a : b;
    return t;
  }
  const double v =
      (*ra)["step_time_s_median"].get<double>() / (*rb)["step_time_s_median"].get<double>();
  t["value"] = v;
  t["pass"] = v <= limit;
  return t;
}

json compute_targets(const json& rows, const BenchConfig& c) {
  json targets = json::object();
  targets["fsdp_fused_prefetch_over_ddp"] =
      ratio_target(rows, "fsdp_fused_prefetch", "ddp", 1.15,
                   "median step time of fsdp_fused_prefetch / ddp (ours) <= 1.15");
  targets["fsdp_fused_prefetch_over_torch_ddp"] =
      ratio_target(rows, "fsdp_fused_prefetch", "torch_ddp", 1.0,
                   "median step time of fsdp_fused_prefetch / PyTorch DDP <= 1.0");
  targets["fsdp_fused_prefetch_over_torch_fsdp2"] =
      ratio_target(rows, "fsdp_fused_prefetch", "torch_fsdp2", 1.0,
                   "median step time of fsdp_fused_prefetch / PyTorch FSDP2 (same model, data "
                   "and ranks) <= 1.0");
  targets["ddp_over_torch_ddp"] = ratio_target(
      rows, "ddp", "torch_ddp", 0.9, "median step time of ddp (ours) / PyTorch DDP <= 0.9");
  targets["tp_over_single"] =
      ratio_target(rows, "tp", "single", 0.75,
                   "median step time of tp (the single row's batch split by layers over the "
                   "ranks) / single <= 0.75 (meant for a compute-bound model: --d 512)");
  {
    const json* tp = find_row(rows, "tp");
    const json* single = find_row(rows, "single");
    json t = {{"what", "peak libtorch memory per rank of tp / single's <= 0.6"}, {"limit", 0.6}};
    if (!tp || !single || (*tp)["peak_bytes_per_rank"].is_null() ||
        (*single)["peak_bytes_per_rank"].is_null()) {
      t["value"] = nullptr;
      t["pass"] = nullptr;
    } else {
      const double v = (*tp)["peak_bytes_per_rank"].get<double>() /
                       (*single)["peak_bytes_per_rank"].get<double>();
      t["value"] = v;
      t["pass"] = v <= 0.6;
    }
    targets["tp_memory_over_single"] = t;
  }

  {
    // Activation checkpointing: memory for compute, on the configuration
    // the target is stated for (BenchConfig); another configuration still
    // reports the ratios, marked as such.
    const json* ac = find_row(rows, "fsdp_ac");
    const json* base = find_row(rows, "fsdp");
    const bool stated = c.layers == 8 && c.d == 256 && c.batch == 32 && c.seq == 128 &&
                        c.ranks == 2;
    json t = {{"what", "fsdp_ac (every block checkpointed) against fsdp on an 8-layer, d 256 GPT "
                       "with batch 32 x 128 per rank on 2 ranks: peak per rank <= 0.4x, median "
                       "step time <= 1.35x"},
              {"limit", {{"peak", 0.4}, {"step_time", 1.35}}},
              {"stated_configuration", stated}};
    if (!ac || !base) {
      t["value"] = nullptr;
      t["pass"] = nullptr;
    } else {
      const double peak = (*ac)["peak_bytes_per_rank"].get<double>() /
                          (*base)["peak_bytes_per_rank"].get<double>();
      const double time = (*ac)["step_time_s_median"].get<double>() /
                          (*base)["step_time_s_median"].get<double>();
      t["value"] = {{"peak", peak}, {"step_time", time}};
      t["pass"] = peak <= 0.4 && time <= 1.35;
      if (!stated) {
        t["note"] = fmt::format("measured on {} layers, d {}, batch {} x {} per rank, {} ranks; "
                                "run hp-bench --rows fsdp,fsdp_ac --layers 8 --batch 32 for the "
                                "stated one",
                                c.layers, c.d, c.batch, c.seq, c.ranks);
      }
    }
    targets["activation_checkpointing_fsdp_ac_over_fsdp"] = t;
  }

  const int64_t units = c.layers + 1;
  for (const std::string name : {"fsdp_fused", "fsdp_fused_prefetch", "hsdp_fused_prefetch"}) {
    const json* r = find_row(rows, name);
    const bool hsdp = name == "hsdp_fused_prefetch";
    json t = {{"what", "with comm_fusion, per step: all_gather <= 2 x units, reduce_scatter <= "
                       "units" + std::string(hsdp ? ", all_reduce <= units" : "") +
                       " (units = layers + 1 = " + std::to_string(units) + ")"},
              {"units", units},
              {"limit", {{"all_gather", 2 * units}, {"reduce_scatter", units}}}};
    if (hsdp) t["limit"]["all_reduce"] = units;
    if (!r) {
      t["value"] = nullptr;
      t["pass"] = nullptr;
    } else {
      const json& cps = (*r)["collectives_per_step"];
      t["value"] = cps;
      bool pass = cps["all_gather"].get<double>() <= 2.0 * units &&
                  cps["reduce_scatter"].get<double>() <= units;
      if (hsdp) pass = pass && cps["all_reduce"].get<double>() <= units;
      t["pass"] = pass;
    }
    targets["collectives_" + name] = t;
  }

  for (const std::string name : {"fsdp_fused_prefetch", "ddp", "hsdp_fused_prefetch"}) {
    const json* r = find_row(rows, name);
    json t = {{"what", "exposed communication (wait / comm seconds) of " + name +
                           " (prefetch on) <= 0.25"},
              {"limit", 0.25}};
    if (!r || (*r)["exposed_comm_fraction"].is_null()) {
      t["value"] = nullptr;
      t["pass"] = nullptr;
    } else {
      const double v = (*r)["exposed_comm_fraction"].get<double>();
      t["value"] = v;
      t["pass"] = v <= 0.25;
    }
    targets["exposed_comm_" + name] = t;
  }

  {
    // The memory plan (P2) against every row of ours. The plan's peak holds
    // what only collectives in flight hold until the code waits for them
    // (the highest a step can reach); a step whose collectives completed
    // sooner peaks up to that much lower (docs/design.md, "Memory plan").
    // So a row's distance is how far its measured peak lies outside
    // [predicted - in flight, predicted], relative to it; the target is 10%.
    json t = {{"what", "plan vs measured: within 10% on every row (outside [predicted - "
                       "in-flight collective buffers, predicted])"},
              {"limit", 0.10}};
    double worst = 0;
    bool any = false;
    json distances = json::object(), errors = json::object();
    for (const auto& r : rows) {
      if (!r.contains("predicted_peak_bytes_per_rank")) continue;
      any = true;
      const double measured = r["peak_bytes_per_rank"].get<double>();
      const double predicted = r["predicted_peak_bytes_per_rank"].get<double>();
      const double low = predicted - r["predicted_in_flight_bytes"].get<double>();
      const double outside = measured > predicted ? measured - predicted
                             : measured < low     ? low - measured
                                                  : 0.0;
      const std::string name = r["name"];
      distances[name] = outside / measured;
      errors[name] = (predicted - measured) / measured;
      worst = std::max(worst, outside / measured);
    }
    t["value"] = any ? json(worst) : json(nullptr);
    t["distance_outside_band"] = distances;
    t["plain_error"] = errors;
    t["pass"] = any ? json(worst <= 0.10) : json(nullptr);
    targets["plan_vs_measured"] = t;
  }

  // The bound is for fusion + zero-copy (fsdp_fused); with prefetch
  // one more unit is gathered ahead by design, so that row is reported
  // against the same bound for comparison.
  for (const std::string name : {"fsdp_fused", "fsdp_fused_prefetch"}) {
    const json* a = find_row(rows, name);
    const json* b = find_row(rows, "fsdp");
    json t = {{"what", "peak bytes per rank of " + name +
                           " <= fsdp's + one block's unsharded parameter bytes"}};
    if (!a || !b) {
      t["value"] = nullptr;
      t["limit"] = nullptr;
      t["pass"] = nullptr;
    } else {
      // The block's bytes as the worker measured them on the model.
      const int64_t unit_bytes = (*b)["block_param_bytes"].get<int64_t>();
      const int64_t v = (*a)["peak_bytes_per_rank"].get<int64_t>();
      const int64_t limit = (*b)["peak_bytes_per_rank"].get<int64_t>() + unit_bytes;
      t["block_param_bytes"] = unit_bytes;
      t["value"] = v;
      t["limit"] = limit;
      t["excess_over_fsdp_bytes"] = v - (*b)["peak_bytes_per_rank"].get<int64_t>();
      t["pass"] = v <= limit;
    }
    targets["peak_memory_" + name] = t;
  }
  return targets;
}

// "PASS", "FAIL", or "n/a " (the target could not be measured).
std::string target_verdict(const json& target) {
  if (target["pass"].is_null()) return "n/a ";
  return target["pass"].get<bool>() ? "PASS" : "FAIL";
}

void print_table(const json& report) {
  fmt::print("\n{:<20} {:>5} {:>10} {:>9} {:>10} {:>9} {:>10} {:>6} {:>6} {:>6} {:>8} {:>8}\n",
             "row", "ranks", "step_s", "tok/s", "peak_MiB", "plan_MiB", "coll/step", "AG", "RS",
             "AR", "exposed", "loss");
  for (const auto& r : report["rows"]) {
    const std::string name = r["name"];
    if (r.contains("skipped")) {
      fmt::print("{:<20} {:>5}  skipped: {}\n", name, r["ranks"].get<int>(),
                 r["skipped"].get<std::string>());
      continue;
    }
    if (r.contains("error")) {
      const std::string error = r["error"];
      fmt::print("{:<20} {:>5}  FAILED: {}\n", name, r["ranks"].get<int>(),
                 error.substr(0, std::min(error.find('\n'), size_t{70})));
      continue;
    }
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
    fmt::print("{:<20} {:>5} {:>10.4f} {:>9.0f} {:>10.1f} {:>9} {:>10.1f} {:>6.1f} {:>6.1f} "
               "{:>6.1f} {:>8} {:>8}{}{}\n",
               name, r["ranks"].get<int>(), r["step_time_s_median"].get<double>(),
               r["tokens_per_s"].get<double>(),
               r["peak_bytes_per_rank"].get<double>() / (1 << 20), plan, c["total"].get<double>(),
               c["all_gather"].get<double>(), c["reduce_scatter"].get<double>(),
               c["all_reduce"].get<double>(), exposed, loss,
               name.rfind("torch_", 0) == 0 ? "  (peak: RSS delta)" : "",
               r.contains("failed_rounds") ? "  [a round failed]" : "");
  }
  fmt::print("\ntargets:\n");
  for (const auto& [name, t] : report["targets"].items()) {
    const std::string verdict = target_verdict(t);
    std::string value = "-";
    if (t["value"].is_number()) {
      value = fmt::format("{:.4g}", t["value"].get<double>());
    } else if (t["value"].is_object() && t["value"].contains("peak")) {
      value = fmt::format("peak {:.3f} time {:.3f}", t["value"]["peak"].get<double>(),
                          t["value"]["step_time"].get<double>());
    } else if (t["value"].is_object()) {
      const json& v = t["value"];
      value = fmt::format("AG {:.1f} RS {:.1f} AR {:.1f}", v["all_gather"].get<double>(),
                          v["reduce_scatter"].get<double>(), v["all_reduce"].get<double>());
    }
    fmt::print("  {}  {:<36} {:<26} limit {}\n", verdict, name, value, t["limit"].dump());
  }
  const json& h = report["hook_overhead"];
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
  const json& d = report["dispatch_overhead"];
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
  std::fflush(stdout);
}

}  // namespace

// The checkpoint row's repeats, each phase's best (fastest) repeat, and the
// targets: save and load at least 0.5x the plain write and read, and peak
// extra memory during save at most one file buffer per rank, taken as the
// largest piece a rank holds (no gather of the model); with checkpoints in a
// training loop (C7), an asynchronous save's stall at most 0.1x a
// synchronous one's and the steps overlapping its write at most 1.15x the
// steps without a save (medians).
json summarize_checkpoint(json result) {
  auto best = [&](const char* key) {
    double b = 0;
    for (const auto& r : result["repeats"]) b = std::max(b, r[key].get<double>());
    return b;
  };
  const double save = best("save_gb_per_s"), write = best("plain_write_gb_per_s");
  const double load = best("load_gb_per_s"), read = best("plain_read_gb_per_s");
  double peak = 0;
  for (const auto& r : result["repeats"]) {
    peak = std::max(peak, r["peak_extra_bytes_during_save_per_rank"].get<double>());
  }
  // Each repeat's ratios too: the plain phase runs right after its
  // checkpoint phase, so a repeat compares under the same machine load.
  std::vector<double> save_ratios, load_ratios;
  for (const auto& r : result["repeats"]) {
    save_ratios.push_back(r["save_gb_per_s"].get<double>() / r["plain_write_gb_per_s"].get<double>());
    load_ratios.push_back(r["load_gb_per_s"].get<double>() / r["plain_read_gb_per_s"].get<double>());
  }
  result["save_vs_plain_write_per_repeat"] = save_ratios;
  result["load_vs_plain_read_per_repeat"] = load_ratios;
  result["best"] = {{"save_gb_per_s", save}, {"plain_write_gb_per_s", write},
                    {"load_gb_per_s", load}, {"plain_read_gb_per_s", read},
                    {"peak_extra_bytes_during_save_per_rank", peak}};
  result["targets"] = {
      {"save_vs_plain_write", {{"ratio", save / write}, {"limit", 0.5}, {"pass", save / write >= 0.5}}},
      {"load_vs_plain_read", {{"ratio", load / read}, {"limit", 0.5}, {"pass", load / read >= 0.5}}},
      {"peak_extra_during_save",
       {{"bytes", peak}, {"limit_bytes", result["largest_piece_bytes"]},
        {"pass", peak <= result["largest_piece_bytes"].get<double>()}}}};
  constexpr double kStallLimit = 0.1, kOverlapLimit = 1.15;
  const json& training = result["training"];
  const double stall_ratio = training["median_async_stall_s"].get<double>() /
                             training["median_sync_stall_s"].get<double>();
  result["targets"]["async_stall_vs_sync"] = {
      {"ratio", stall_ratio}, {"limit", kStallLimit}, {"pass", stall_ratio <= kStallLimit}};
  json step_target = {{"limit", kOverlapLimit}};
  if (training["overlapping_steps"].get<int64_t>() == 0) {
    step_target["ratio"] = nullptr;
    step_target["pass"] = nullptr;
    step_target["note"] = "no training step overlapped a background write";
  } else {
    const double step_ratio = training["median_step_overlapping_write_s"].get<double>() /
                              training["median_step_without_save_s"].get<double>();
    step_target["ratio"] = step_ratio;
    step_target["pass"] = step_ratio <= kOverlapLimit;
  }
  result["targets"]["overlapping_step_vs_without_save"] = step_target;
  return result;
}

void print_checkpoint(const json& c) {
  const json& b = c["best"];
  std::cout << fmt::format(
                   "\ncheckpoint ({:.1f}M parameters + AdamW, {:.2f} GB, {} ranks, {} on {}):\n"
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
  std::cout << fmt::format(
      "  in training ({} tokens per rank per step): stall per save sync {:.3f} s, async {:.3f} s "
      "({:.3f}x, target <= {}x: {})\n"
      "  step time without a save {:.3f} s, overlapping an async write {:.3f} s over {} steps "
      "({}, target <= {}x: {})\n",
      t["tokens_per_rank_per_step"].get<int64_t>(), t["median_sync_stall_s"].get<double>(),
      t["median_async_stall_s"].get<double>(), stall["ratio"].get<double>(),
      stall["limit"].get<double>(), target_verdict(stall),
      t["median_step_without_save_s"].get<double>(),
      t["median_step_overlapping_write_s"].get<double>(), t["overlapping_steps"].get<int64_t>(),
      overlap["ratio"].is_null() ? std::string("n/a")
                                 : fmt::format("{:.2f}x", overlap["ratio"].get<double>()),
      overlap["limit"].get<double>(), target_verdict(overlap));
}

int run_driver(DriverOptions o) {
  BenchConfig& c = o.config;
  if (o.rows.empty()) o.rows = row_names();
  // The checkpoint row is no step-time row: it runs once, after the rounds.
  const auto checkpoint_row = std::find(o.rows.begin(), o.rows.end(), "checkpoint");
  const bool run_checkpoint = checkpoint_row != o.rows.end();
  if (run_checkpoint) o.rows.erase(checkpoint_row);
  const std::string self = self_path();
  const fs::path build_dir = fs::path(self).parent_path().parent_path();
  if (o.hprun.empty()) o.hprun = (build_dir / "tools" / "hprun" / "hprun").string();
  if (o.torch_script.empty()) o.torch_script = std::string(HP_BENCH_SOURCE_DIR) + "/torch_ddp_baseline.py";
  if (o.plot_script.empty()) o.plot_script = std::string(HP_BENCH_SOURCE_DIR) + "/plot_bench.py";
  if (!fs::exists(o.hprun)) {
    throw std::runtime_error("hprun not found at " + o.hprun +
                             " (build it: ninja hprun, or pass --hprun PATH)");
  }
  c.steps = (o.total_steps + o.rounds - 1) / o.rounds;

  // Fair threading on both sides: one intra-op thread per rank.
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}) {
    setenv(name, "1", 1);
  }

  char tmpl[] = "/tmp/hp-bench.XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  const fs::path tmp = tmpl;
  c.tokens_path = (tmp / "tokens.u16").string();
  write_tokens(c.tokens_path, c, std::max(c.ranks, c.hsdp_ranks));

  json config = {
      {"model", {{"kind", "GPT-2 (hp::nn::GPT / tests/nn/gpt_reference.py)"},
                 {"vocab", c.vocab}, {"seq", c.seq}, {"d", c.d}, {"heads", c.heads},
                 {"layers", c.layers}, {"ctx", c.ctx}, {"dtype", "float32"}}},
      {"batch_per_rank", c.batch},
      {"optimizer", {{"kind", "AdamW"}, {"lr", c.lr}, {"betas", {c.beta1, c.beta2}},
                     {"eps", c.eps}, {"weight_decay", c.weight_decay}}},
      {"data", "uniform random token ids (std::mt19937_64 seed " + std::to_string(c.seed) +
                   "), one file read by every row; hp-train's batch rule (batch_for_step)"},
      {"seed", c.seed},
      {"ranks", c.ranks},
      {"hsdp_ranks", c.hsdp_ranks},
      {"hsdp_mesh", hsdp_mesh(c.hsdp_ranks)},
      {"threads_per_rank", 1},
      {"thread_env", "OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=MKL_NUM_THREADS=1 for every child; "
                     "at::set_num_threads(1) / torch.set_num_threads(1)"},
      {"warmup_steps_per_process", c.warmup},
      {"timed_steps_per_process", c.steps},
      {"rounds", o.rounds},
      {"timing", "per step: zero_grad + batch slice + forward + loss + backward + AdamW step, "
                 "no barrier; each step's time is the max over ranks (gathered after the timed "
                 "steps); the figure is the median over all timed steps of all rounds. Rounds "
                 "run every row once, in forward order then reversed, never two rows at once."},
      {"libtorch", TORCH_VERSION},
      {"machine", {{"cores", std::thread::hardware_concurrency()},
                   {"load_average_at_start", load_average()}}},
      {"note", hsdp_note(c)}};

  std::map<std::string, std::vector<json>> results;
  std::map<std::string, std::string> errors;
  std::map<std::string, json> skipped;
  for (int round = 0; round < o.rounds; ++round) {
    std::vector<std::string> order = o.rows;
    if (round % 2 == 1) std::reverse(order.begin(), order.end());
    for (const auto& row : order) {
      const int n = row_ranks(row, c);
      std::vector<std::string> argv = {o.hprun, "-n", std::to_string(n), "--timeout",
                                       std::to_string(static_cast<int>(o.row_timeout_s))};
      if (row == "torch_ddp") {
        argv.push_back(o.python);
        argv.push_back(o.torch_script);
      } else if (row == "torch_fsdp2") {
        argv.push_back(o.python);
        const fs::path script = fs::path(o.torch_script).parent_path() / "torch_fsdp2_baseline.py";
        argv.push_back(script.string());
      } else {
        argv.push_back(self);
        argv.push_back("--worker");
        argv.push_back(row);
      }
      for (const auto& a : c.worker_args()) argv.push_back(a);
      const std::string label =
          row + " (round " + std::to_string(round + 1) + "/" + std::to_string(o.rounds) + ")";
      RunOutcome out = launch(label, argv, o.verbose);
      if (!out.ok) {
        // Reported (and the exit status says so), but later rounds still try:
        // a row that failed once may still give numbers.
        errors[row] += "round " + std::to_string(round + 1) + ": " + out.error;
        continue;
      }
      if (out.result.contains("skipped")) {  // e.g. torch_fsdp2 on a PyTorch without FSDP2
        skipped[row] = out.result;
        std::cerr << "[hp-bench] " << label << ": skipped ("
                  << out.result["skipped"].get<std::string>() << ")" << std::endl;
        continue;
      }
      results[row].push_back(out.result);
      std::cerr << "[hp-bench] " << label << ": median "
                << fmt::format("{:.4f} s/step ({:.1f} s wall)",
                               median(out.result["step_times_s"].get<std::vector<double>>()),
                               out.wall_s)
                << std::endl;
    }
  }

  json rows = json::array();
  for (const auto& row : o.rows) {
    if (results[row].empty() && skipped.count(row) && !errors.count(row)) {
      rows.push_back({{"name", row}, {"ranks", row_ranks(row, c)},
                      {"skipped", skipped[row]["skipped"]},
                      {"torch_version", skipped[row].value("torch_version", json(nullptr))},
                      {"step_time_s_median", nullptr}, {"tokens_per_s", nullptr},
                      {"peak_bytes_per_rank", nullptr}, {"collectives_per_step", nullptr},
                      {"exposed_comm_fraction", nullptr}});
      continue;
    }
    if (results[row].empty()) {
      json r = {{"name", row}, {"ranks", row_ranks(row, c)}, {"error", errors[row]},
                {"step_time_s_median", nullptr}, {"tokens_per_s", nullptr},
                {"peak_bytes_per_rank", nullptr}, {"collectives_per_step", nullptr},
                {"exposed_comm_fraction", nullptr}};
      if (row == "hsdp_fused_prefetch") r["note"] = hsdp_note(c);
      rows.push_back(r);
      continue;
    }
    json r = summarize(row, results[row], c, row_ranks(row, c));
    if (errors.count(row)) r["failed_rounds"] = errors[row];
    rows.push_back(r);
  }

  json hook = json::object();
  bool hook_failed = false;
  if (o.hook_overhead) {
    std::vector<std::string> argv = {o.hprun, "-n", "1", "--timeout",
                                     std::to_string(static_cast<int>(o.row_timeout_s)), self,
                                     "--worker", "hook_overhead"};
    for (const auto& a : c.worker_args()) argv.push_back(a);
    RunOutcome out = launch("hook_overhead", argv, o.verbose);
    if (out.ok) {
      hook = out.result;
      const json& fs_variant = hook["variants"]["fully_shard"];
      hook["overhead_us_per_unit_per_step"] = fs_variant["overhead_us_per_unit_per_step"];
      hook["target_us_per_unit_per_step"] = 20.0;
      hook["pass"] = fs_variant["overhead_us_per_unit_per_step"].get<double>() <= 20.0;
    } else {
      hook = {{"error", out.error}, {"pass", nullptr}};
      hook_failed = true;
    }
  }

  json dispatch = json::object();
  bool dispatch_failed = false;
  if (o.dispatch_overhead) {
    std::vector<std::string> argv = {o.hprun, "-n", "2", "--timeout",
                                     std::to_string(static_cast<int>(o.row_timeout_s)), self,
                                     "--worker", "dispatch_overhead"};
    for (const auto& a : c.worker_args()) argv.push_back(a);
    RunOutcome out = launch("dispatch_overhead", argv, o.verbose);
    if (out.ok) {
      dispatch = out.result;
      dispatch["target_us_per_op"] = 1.0;
      dispatch["pass"] = dispatch["worst_overhead_us_per_op"].get<double>() <= 1.0;
    } else {
      dispatch = {{"error", out.error}, {"pass", nullptr}};
      dispatch_failed = true;
    }
  }

  json checkpoint_report = nullptr;
  bool checkpoint_failed = false;
  if (run_checkpoint) {
    std::vector<std::string> argv = {o.hprun, "-n", std::to_string(c.ranks), "--timeout",
                                     std::to_string(static_cast<int>(o.row_timeout_s) * 3), self,
                                     "--worker", "checkpoint"};
    for (const auto& a : c.worker_args()) argv.push_back(a);
    RunOutcome out = launch("checkpoint", argv, o.verbose);
    if (out.ok) {
      checkpoint_report = summarize_checkpoint(out.result);
    } else {
      checkpoint_report = {{"error", out.error}};
      checkpoint_failed = true;
      errors["checkpoint"] = out.error;
    }
  }

  config["machine"]["load_average_at_end"] = load_average();
  json report = {{"config", config},
                 {"rows", rows},
                 {"targets", compute_targets(rows, c)},
                 {"hook_overhead", hook},
                 {"dispatch_overhead", dispatch}};
  if (run_checkpoint) report["checkpoint"] = checkpoint_report;
  print_table(report);
  if (run_checkpoint && !checkpoint_failed) print_checkpoint(checkpoint_report);

  std::error_code ec;
  fs::remove_all(tmp, ec);
  const fs::path json_path = o.json_path;
  if (json_path.has_parent_path()) fs::create_directories(json_path.parent_path(), ec);
  {
    std::ofstream out(o.json_path);
    out << report.dump(2) << "\n";
    if (!out) throw std::runtime_error("cannot write " + o.json_path);
  }
  std::cout << "\nwrote " << o.json_path << std::endl;

  bool plot_failed = false;
  if (!o.png_path.empty()) {
    const fs::path png = o.png_path;
    if (png.has_parent_path()) fs::create_directories(png.parent_path(), ec);
    ChildOutcome plot = run_child({o.python, o.plot_script, o.json_path, o.png_path},
                                  [](const std::string& line) { std::cerr << line << "\n"; });
    if (tools::shell_status(plot.result) != 0) {
      std::cerr << "[hp-bench] plot failed (" << tools::describe_exit(plot.result) << ")"
                << std::endl;
      plot_failed = true;
    } else {
      std::cout << "wrote " << o.png_path << std::endl;
    }
  }

  if (!errors.empty() || hook_failed || dispatch_failed || plot_failed) {
    std::cerr << "[hp-bench] failed:";
    for (const auto& [row, e] : errors) std::cerr << " " << row;
    if (hook_failed) std::cerr << " hook_overhead";
    if (dispatch_failed) std::cerr << " dispatch_overhead";
    if (plot_failed) std::cerr << " plot";
    std::cerr << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace hp::bench
