#include "bench/row_summary.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>

#include "bench/median.h"
#include "bench/pipeline_bubble.h"

namespace hp::bench {

using json = nlohmann::json;

namespace {

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

json number_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// Step times of all rounds: median, p10, p90, tokens per second; the last
// round's losses. Returns the pooled step times.
std::vector<double> add_timing(json& row, const Row& spec, const std::vector<json>& runs,
                               const BenchConfig& c) {
  std::vector<double> times;
  json by_round = json::array();
  for (const auto& r : runs) {
    const auto round_times = r["step_times_s"].get<std::vector<double>>();
    times.insert(times.end(), round_times.begin(), round_times.end());
    if (r.contains("round")) {
      by_round.push_back({{"round", r["round"]}, {"median", number_or_null(median(round_times))}});
    }
  }
  const double med = median(times);
  row["step_time_s_round_medians"] = by_round;
  row["step_time_s_median"] = number_or_null(med);
  row["step_time_s_p10"] = number_or_null(quantile(times, 0.1));
  row["step_time_s_p90"] = number_or_null(quantile(times, 0.9));
  row["steps_timed"] = times.size();
  row["rounds"] = runs.size();
  const double tokens = static_cast<double>(spec.samples_per_step(c) * c.seq);
  row["tokens_per_s"] = number_or_null(tokens / med);
  const json& last = runs.back();
  row["first_loss"] = last.value("first_loss", json(nullptr));
  row["last_loss"] = last["losses"].empty() ? json(nullptr) : last["losses"].back();
  return times;
}

// Per rank, the highest value of `key` over every round.
std::vector<int64_t> max_over_rounds(const std::vector<json>& runs, const char* key) {
  std::vector<int64_t> each;
  for (const auto& r : runs) {
    const auto v = r[key].get<std::vector<int64_t>>();
    if (each.size() < v.size()) each.resize(v.size(), 0);
    for (size_t i = 0; i < v.size(); ++i) each[i] = std::max(each[i], v[i]);
  }
  return each;
}

int64_t highest(const std::vector<int64_t>& v) { return *std::max_element(v.begin(), v.end()); }

// The memory plan's prediction (P2) for the measured quantity (its steady
// step), the highest rank, beside the measured one.
void add_plan(json& row, const json& last) {
  if (!last.contains("predicted_peak_bytes_per_rank")) return;
  const auto predicted = last["predicted_peak_bytes_per_rank"].get<std::vector<int64_t>>();
  const auto in_flight = last["predicted_in_flight_bytes_per_rank"].get<std::vector<int64_t>>();
  const size_t top = std::max_element(predicted.begin(), predicted.end()) - predicted.begin();
  row["predicted_peak_bytes_per_rank"] = predicted[top];
  row["predicted_in_flight_bytes"] = in_flight[top];
  row["predicted_peak_each_rank"] = predicted;
  row["plan_error"] =
      static_cast<double>(predicted[top] - row["peak_bytes_per_rank"].get<int64_t>()) /
      row["peak_bytes_per_rank"].get<double>();
}

// Memory: the highest rank over every round.
void add_memory(json& row, const Row& spec, const std::vector<json>& runs) {
  const std::vector<int64_t> rss = max_over_rounds(runs, "peak_rss_delta_bytes_per_rank");
  row["peak_rss_delta_bytes_per_rank"] = highest(rss);
  if (spec.torch()) {
    row["peak_bytes_per_rank"] = row["peak_rss_delta_bytes_per_rank"];
    row["peak_bytes_method"] =
        "rss_delta: getrusage ru_maxrss after the timed steps minus VmRSS before the model was "
        "built (whole process, includes allocator caching and fragmentation; PyTorch has no "
        "counting CPU allocator)";
    row["peak_bytes_each_rank"] = rss;
  } else {
    const std::vector<int64_t> peaks = max_over_rounds(runs, "peak_bytes_per_rank");
    row["peak_bytes_per_rank"] = highest(peaks);
    row["peak_bytes_method"] =
        "hp::memory_stats: peak live bytes of libtorch's CPU allocator over the timed steps "
        "(tracking enabled before the model was built; excludes Gloo's own buffers)";
    row["peak_bytes_each_rank"] = peaks;
    add_plan(row, runs.back());
  }
  row["peak_rss_delta_method"] =
      "getrusage ru_maxrss at the end minus VmRSS before the model was built, max over ranks";
}

// What the process cost the kernel per timed step (getrusage, every
// thread): kernel CPU time over the timed steps and the median step's minor
// page faults, averaged over the ranks, the median over the rounds. Unlike
// step times, these hardly move with the machine's load.
// The runs' per-rank figure `key`: each round's mean over the ranks (divided
// by the round's `per`, when given), the median over the rounds, times
// `scale`; null where no round has it.
json rank_mean_round_median(const std::vector<json>& runs, const char* key, double scale,
                            const char* per = nullptr) {
  std::vector<double> by_round;
  for (const auto& r : runs) {
    if (!r.contains(key) || (per && !r.contains(per))) continue;
    const auto each = r[key].get<std::vector<double>>();
    double sum = 0;
    for (double v : each) sum += v;
    by_round.push_back(sum / static_cast<double>(each.size()) / (per ? r[per].get<double>() : 1.0));
  }
  return by_round.empty() ? json(nullptr) : number_or_null(scale * median(by_round));
}

void add_kernel_work(json& row, const std::vector<json>& runs) {
  row["kernel_ms_per_step"] = rank_mean_round_median(runs, "kernel_s_per_step_per_rank", 1e3);
  row["page_faults_per_step"] = rank_mean_round_median(runs, "page_faults_per_step_per_rank", 1.0);
}

// The host's time to issue one step (bench_worker.cpp, and the same on
// PyTorch's side), per unit (fully_shard's: the blocks and the root, the
// same count for PyTorch) in ms: averaged over the ranks, the median over
// the rounds. On a GPU this is the CPU overhead a C++ runtime saves; on the
// CPU it is the whole step.
void add_host_time(json& row, const std::vector<json>& runs) {
  row["host_ms_per_unit_step"] =
      rank_mean_round_median(runs, "host_s_per_step_per_rank", 1e3, "units");
}

// A GPU row: its memory is the CUDA caching allocator's peak (ours and
// PyTorch's alike), against which our rows' plan is judged, and its
// exposed communication, for ours, the share of the step the compute
// stream stood at a collective's wait.
void add_gpu_figures(json& row, const Row& spec, const std::vector<json>& runs) {
  const json& last = runs.back();
  row["device"] = last.value("device", std::string("cpu"));
  if (!last.contains("cuda_peak_allocated_bytes_per_rank")) return;
  const std::vector<int64_t> allocated = max_over_rounds(runs, "cuda_peak_allocated_bytes_per_rank");
  const std::vector<int64_t> reserved = max_over_rounds(runs, "cuda_peak_reserved_bytes_per_rank");
  row["peak_bytes_per_rank"] = highest(allocated);
  row["peak_bytes_each_rank"] = allocated;
  row["cuda_peak_reserved_bytes_per_rank"] = highest(reserved);
  row["peak_bytes_method"] =
      "the CUDA caching allocator's peak allocated bytes over the timed steps "
      "(torch.cuda.max_memory_allocated on PyTorch's side), max over ranks";
  if (!spec.torch()) add_plan(row, last);  // against the GPU's peak
  row["param_dtype"] = last.value("param_dtype", json(nullptr));
  if (spec.torch() || !spec.communicates) return;
  double exposed = 0, steps = 0;
  for (const auto& r : runs) {
    for (double v : r["exposed_comm_seconds_per_rank"]) exposed += v;
    for (double v : r["step_times_s"]) steps += v;
  }
  const double ranks = static_cast<double>(last["exposed_comm_seconds_per_rank"].size());
  row["exposed_comm_fraction"] = steps > 0 ? json(exposed / ranks / steps) : json(nullptr);
  row["exposed_comm_method"] =
      "GPU time the compute stream stood at a collective's wait (CUDA events around each "
      "Work::wait, hp::dist::stream_wait_seconds), mean over ranks / the timed steps' GPU time";
}

// A PyTorch row's own count of its collectives (the last round's).
void add_torch_collectives(json& row, const json& last) {
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
}

// Our rows' hp::dist::comm_stats() over every round, per timed step.
void add_our_collectives(json& row, const Row& spec, const std::vector<json>& runs, double steps,
                         double ranks) {
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
  row["comm_seconds_per_step"] = comm / steps / ranks;  // mean over ranks
  row["wait_seconds_per_step"] = wait / steps / ranks;
  const bool measured = spec.communicates && comm > 0;
  row["exposed_comm_fraction"] = measured ? json(wait / comm) : json(nullptr);
  row["exposed_comm_method"] =
      "sum over ranks of wait_seconds (blocked in Work::wait) / sum of comm_seconds (issue to "
      "completion) over the timed steps";
}

// What our worker reports of its setup (the last round's).
void add_our_setup(json& row, const json& last) {
  for (const char* key : {"mesh", "mesh_names", "comm_fusion", "prefetch"}) row[key] = last[key];
  row["activation_checkpointing"] = last.value("activation_checkpointing", false);
  for (const char* key : {"parameters", "block_param_bytes", "end_bytes_per_rank"}) {
    row[key] = last[key];
  }
}

json named_row(const Row& spec, const BenchConfig& c) {
  return {{"name", spec.name}, {"ranks", spec.ranks(c)}};
}

// The figures a row without measurements has, all null.
void add_unmeasured(json& row) {
  for (const char* key :
       {"step_time_s_median", "tokens_per_s", "peak_bytes_per_rank", "collectives_per_step",
        "exposed_comm_fraction", "kernel_ms_per_step", "page_faults_per_step"}) {
    row[key] = nullptr;
  }
}

// The checkpoint row's training targets (C7): the stall of an asynchronous
// save against a synchronous one, and steps overlapping its write against
// steps without a save.
void add_checkpoint_training_targets(json& result) {
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
}

}  // namespace

json summarize_row(const Row& spec, const std::vector<json>& runs, const BenchConfig& c) {
  json row = named_row(spec, c);
  const std::vector<double> times = add_timing(row, spec, runs, c);
  add_memory(row, spec, runs);
  add_kernel_work(row, runs);
  const json& last = runs.back();
  if (spec.torch()) {
    add_torch_collectives(row, last);
  } else {
    add_our_collectives(row, spec, runs, static_cast<double>(times.size()),
                        static_cast<double>(spec.ranks(c)));
    add_our_setup(row, last);
  }
  add_host_time(row, runs);
  add_gpu_figures(row, spec, runs);
  if (pipeline_row(spec)) row["pipeline"] = summarize_pipeline(runs);
  if (spec.note) row["note"] = spec.note(c);
  row["round_medians_s"] = json::array();
  for (const auto& r : runs) {
    row["round_medians_s"].push_back(median(r["step_times_s"].get<std::vector<double>>()));
  }
  return row;
}

json skipped_row(const Row& spec, const json& skipped, const BenchConfig& c) {
  json row = named_row(spec, c);
  row["skipped"] = skipped["skipped"];
  row["torch_version"] = skipped.value("torch_version", json(nullptr));
  add_unmeasured(row);
  return row;
}

json failed_row(const Row& spec, const std::string& error, const BenchConfig& c) {
  json row = named_row(spec, c);
  row["error"] = error;
  add_unmeasured(row);
  if (spec.note) row["note"] = spec.note(c);
  return row;
}

json summarize_checkpoint(json result) {
  auto best = [&](const char* key) {
    double b = 0;
    for (const auto& r : result["repeats"]) b = std::max(b, r[key].get<double>());
    return b;
  };
  const double save = best("save_gb_per_s"), write = best("plain_write_gb_per_s");
  const double load = best("load_gb_per_s"), read = best("plain_read_gb_per_s");
  const double peak = best("peak_extra_bytes_during_save_per_rank");
  // Each repeat's ratios too: the plain phase runs right after its
  // checkpoint phase, so a repeat compares under the same machine load.
  std::vector<double> save_ratios, load_ratios;
  for (const auto& r : result["repeats"]) {
    save_ratios.push_back(r["save_gb_per_s"].get<double>() /
                          r["plain_write_gb_per_s"].get<double>());
    load_ratios.push_back(r["load_gb_per_s"].get<double>() /
                          r["plain_read_gb_per_s"].get<double>());
  }
  result["save_vs_plain_write_per_repeat"] = save_ratios;
  result["load_vs_plain_read_per_repeat"] = load_ratios;
  result["best"] = {{"save_gb_per_s", save}, {"plain_write_gb_per_s", write},
                    {"load_gb_per_s", load}, {"plain_read_gb_per_s", read},
                    {"peak_extra_bytes_during_save_per_rank", peak}};
  const double largest_piece = result["largest_piece_bytes"].get<double>();
  result["targets"] = {
      {"save_vs_plain_write",
       {{"ratio", save / write}, {"limit", 0.5}, {"pass", save / write >= 0.5}}},
      {"load_vs_plain_read",
       {{"ratio", load / read}, {"limit", 0.5}, {"pass", load / read >= 0.5}}},
      {"peak_extra_during_save",
       {{"bytes", peak}, {"limit_bytes", result["largest_piece_bytes"]},
        {"pass", peak <= largest_piece}}}};
  add_checkpoint_training_targets(result);
  return result;
}

}  // namespace hp::bench
