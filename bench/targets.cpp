#include "bench/targets.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "bench/rows.h"

namespace hp::bench {

using json = nlohmann::json;

namespace {

constexpr const char* kStepTime = "step_time_s_median";
constexpr const char* kPeak = "peak_bytes_per_rank";

const std::vector<RatioTarget> kRatioTargets = {
    {"fsdp_fused_prefetch_over_ddp", "fsdp_fused_prefetch", "ddp", kStepTime, 1.15,
     "median step time of fsdp_fused_prefetch / ddp (ours) <= 1.15"},
    {"fsdp_fused_prefetch_over_torch_ddp", "fsdp_fused_prefetch", "torch_ddp", kStepTime, 1.0,
     "median step time of fsdp_fused_prefetch / PyTorch DDP <= 1.0"},
    {"fsdp_fused_prefetch_over_torch_fsdp2", "fsdp_fused_prefetch", "torch_fsdp2", kStepTime, 0.8,
     "median step time of fsdp_fused_prefetch / PyTorch FSDP2 (same model, data and ranks) <= "
     "0.8"},
    {"ddp_over_torch_ddp", "ddp", "torch_ddp", kStepTime, 1.0,
     "median step time of ddp (ours) / PyTorch DDP <= 1.0"},
    {"single_over_torch_single", "single", "torch_single", kStepTime, 1.0,
     "median step time of single (plain libtorch, one process) / PyTorch in one process (same "
     "model, data and steps, no wrapper) <= 1.0"},
    {"tp_over_single", "tp", "single", kStepTime, 0.75,
     "median step time of tp (the single row's batch split by layers over the ranks) / single "
     "<= 0.75 (meant for a compute-bound model: --d 512)"},
    {"tp_memory_over_single", "tp", "single", kPeak, 0.6,
     "peak libtorch memory per rank of tp / single's <= 0.6"},
    // Pipeline parallelism: our executor against torch.distributed.pipelining
    // on the same stages, micro-batches and schedule (docs/bench.md,
    // "Pipeline rows").
    {"pp4_over_torch_pp4", "pp4", "torch_pp4", kStepTime, 0.8,
     "median step time of pp4 (1F1B over 4 ranks) / PyTorch's Schedule1F1B <= 0.8"},
    {"pp4_gpipe_over_torch_pp4_gpipe", "pp4_gpipe", "torch_pp4_gpipe", kStepTime, 0.8,
     "median step time of pp4_gpipe / PyTorch's ScheduleGPipe <= 0.8"},
    {"pp4_interleaved_over_torch_pp4_interleaved", "pp4_interleaved", "torch_pp4_interleaved",
     kStepTime, 0.8,
     "median step time of pp4_interleaved (v = 2) / PyTorch's ScheduleInterleaved1F1B <= 0.8"},
    {"pp4_zero_bubble_over_torch_pp4_zero_bubble", "pp4_zero_bubble", "torch_pp4_zero_bubble",
     kStepTime, 0.8,
     "median step time of pp4_zero_bubble (v = 2) / PyTorch's ScheduleInterleavedZeroBubble "
     "<= 0.8"},
    {"dp2_pp2_over_torch_dp2_pp2", "dp2_pp2", "torch_dp2_pp2", kStepTime, 1.0,
     "median step time of dp2_pp2 ((dp, pp) = (2, 2): fully_shard inside the stages, 1F1B) / "
     "PyTorch's FSDP2 + Schedule1F1B <= 1.0"},
};

// The row called `name` if it has a median step time (it ran).
const json* find_row(const json& rows, const std::string& name) {
  for (const auto& r : rows) {
    if (r["name"] == name && r.contains(kStepTime) && !r[kStepTime].is_null()) return &r;
  }
  return nullptr;
}

json unmeasured(json t) {
  t["value"] = nullptr;
  t["pass"] = nullptr;
  return t;
}

// The ratio in each round both rows ran. A round runs the rows back to
// back, so a slower or faster spell of the machine moves both; the spread of
// these ratios is how far one run's ratio can be trusted on this machine.
std::vector<double> round_ratios(const json& a, const json& b) {
  std::vector<double> ratios;
  const char* key = "step_time_s_round_medians";
  if (!a.contains(key) || !b.contains(key)) return ratios;
  for (const auto& ra : a[key]) {
    for (const auto& rb : b[key]) {
      if (ra["round"] != rb["round"] || ra["median"].is_null() || rb["median"].is_null()) continue;
      ratios.push_back(ra["median"].get<double>() / rb["median"].get<double>());
    }
  }
  return ratios;
}

json ratio_target(const json& rows, const RatioTarget& target) {
  const json* a = find_row(rows, target.numerator);
  const json* b = find_row(rows, target.denominator);
  json t = {{"what", target.what}, {"limit", target.limit}};
  if (!a || !b) {
    t = unmeasured(t);
    t["missing"] = !a ? target.numerator : target.denominator;
    return t;
  }
  if ((*a)[target.metric].is_null() || (*b)[target.metric].is_null()) return unmeasured(t);
  const double v = (*a)[target.metric].get<double>() / (*b)[target.metric].get<double>();
  t["value"] = v;
  t["pass"] = v <= target.limit;
  const std::vector<double> per_round =
      std::string(target.metric) == kStepTime ? round_ratios(*a, *b) : std::vector<double>{};
  if (per_round.size() > 1) {
    // The verdict is the pooled medians'; it is conclusive when every
    // round's ratio lies on the verdict's side of the limit.
    const auto [lo, hi] = std::minmax_element(per_round.begin(), per_round.end());
    t["per_round"] = per_round;
    t["range"] = {*lo, *hi};
    t["conclusive"] = v <= target.limit ? *hi <= target.limit : *lo > target.limit;
  }
  return t;
}

// Activation checkpointing: memory for compute, on the configuration the
// target is stated for (BenchConfig); another configuration still reports
// the ratios, marked as such.
json activation_checkpointing_target(const json& rows, const BenchConfig& c) {
  const json* ac = find_row(rows, "fsdp_ac");
  const json* base = find_row(rows, "fsdp");
  const bool stated = c.layers == 8 && c.d == 256 && c.batch == 32 && c.seq == 128 &&
                      c.ranks == 2;
  json t = {{"what", "fsdp_ac (every block checkpointed) against fsdp on an 8-layer, d 256 GPT "
                     "with batch 32 x 128 per rank on 2 ranks: peak per rank <= 0.4x, median "
                     "step time <= 1.35x"},
            {"limit", {{"peak", 0.4}, {"step_time", 1.35}}},
            {"stated_configuration", stated}};
  if (!ac || !base) return unmeasured(t);
  const double peak = (*ac)[kPeak].get<double>() / (*base)[kPeak].get<double>();
  const double time = (*ac)[kStepTime].get<double>() / (*base)[kStepTime].get<double>();
  t["value"] = {{"peak", peak}, {"step_time", time}};
  t["pass"] = peak <= 0.4 && time <= 1.35;
  if (!stated) {
    t["note"] = fmt::format("measured on {} layers, d {}, batch {} x {} per rank, {} ranks; "
                            "run hp-bench --rows fsdp,fsdp_ac --layers 8 --batch 32 for the "
                            "stated one",
                            c.layers, c.d, c.batch, c.seq, c.ranks);
  }
  return t;
}

// With comm_fusion, per step: all_gather <= 2 x units, reduce_scatter <=
// units, and with `hsdp` (a replicate dimension) all_reduce <= units.
json fused_collectives_target(const json& rows, const std::string& name, bool hsdp,
                              int64_t units) {
  const json* r = find_row(rows, name);
  json t = {{"what", "with comm_fusion, per step: all_gather <= 2 x units, reduce_scatter <= "
                     "units" + std::string(hsdp ? ", all_reduce <= units" : "") +
                     " (units = layers + 1 = " + std::to_string(units) + ")"},
            {"units", units},
            {"limit", {{"all_gather", 2 * units}, {"reduce_scatter", units}}}};
  if (hsdp) t["limit"]["all_reduce"] = units;
  if (!r) return unmeasured(t);
  const json& cps = (*r)["collectives_per_step"];
  t["value"] = cps;
  bool pass = cps["all_gather"].get<double>() <= 2.0 * units &&
              cps["reduce_scatter"].get<double>() <= units;
  if (hsdp) pass = pass && cps["all_reduce"].get<double>() <= units;
  t["pass"] = pass;
  return t;
}

// On the CPU the share of the collectives' time the host waited, <= 0.25;
// on a GPU the share of the step the compute stream stood at a wait, <= 0.15.
json exposed_comm_target(const json& rows, const std::string& name, bool gpu) {
  const json* r = find_row(rows, name);
  const double limit = gpu ? 0.15 : 0.25;
  json t = {{"what", gpu ? "exposed communication (GPU time the compute stream stood at a "
                           "collective's wait / step time) of " + name + " <= 0.15"
                         : "exposed communication (wait / comm seconds) of " + name +
                               " (prefetch on) <= 0.25"},
            {"limit", limit}};
  if (!r || (*r)["exposed_comm_fraction"].is_null()) return unmeasured(t);
  const double v = (*r)["exposed_comm_fraction"].get<double>();
  t["value"] = v;
  t["pass"] = v <= limit;
  return t;
}

// On a GPU in a world of one, fully_shard must cost next to nothing over
// the same model without it: both do the same work per step, and the
// unit's all-gather and reduce-scatter of one rank are copies.
json gpu_world_of_one_target(const json& rows, const BenchConfig& c) {
  RatioTarget ratio{"", "fsdp_fused_prefetch", "single", kStepTime, 1.03, ""};
  json t = ratio_target(rows, ratio);
  t["what"] = "on a GPU with --ranks 1: median step time of fsdp_fused_prefetch / single (the "
              "model without fully_shard) <= 1.03";
  if (c.ranks != 1) {
    t = unmeasured(t);
    t["note"] = fmt::format("measured with --ranks {}: the rows' work differs; run hp-bench "
                            "--device cuda --ranks 1 --param-dtype fp32 for this target",
                            c.ranks);
  } else if (c.param_dtype != "fp32") {
    t = unmeasured(t);
    t["note"] = "single computes in fp32: compare with --param-dtype fp32";
  }
  return t;
}

// The memory plan (P2) against every row of ours. The plan's peak holds
// what only collectives in flight hold until the code waits for them (the
// highest a step can reach); a step whose collectives completed sooner peaks
// up to that much lower (docs/design.md, "Memory plan"). So a row's distance
// is how far its measured peak lies outside [predicted - in flight,
// predicted], relative to it; the target is 10%.
json plan_target(const json& rows) {
  json t = {{"what", "plan vs measured: within 10% on every row (outside [predicted - "
                     "in-flight collective buffers, predicted])"},
            {"limit", 0.10}};
  double worst = 0;
  bool any = false;
  json distances = json::object(), errors = json::object();
  for (const auto& r : rows) {
    if (!r.contains("predicted_peak_bytes_per_rank")) continue;
    any = true;
    const double measured = r[kPeak].get<double>();
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
  return t;
}

// The bound is for fusion + zero-copy (fsdp_fused); with prefetch one more
// unit is gathered ahead by design, so that row is reported against the same
// bound for comparison.
json fused_peak_target(const json& rows, const std::string& name) {
  const json* a = find_row(rows, name);
  const json* b = find_row(rows, "fsdp");
  json t = {{"what", "peak bytes per rank of " + name +
                         " <= fsdp's + one block's unsharded parameter bytes"}};
  if (!a || !b) {
    t["limit"] = nullptr;
    return unmeasured(t);
  }
  // The block's bytes as the worker measured them on the model.
  const int64_t unit_bytes = (*b)["block_param_bytes"].get<int64_t>();
  const int64_t v = (*a)[kPeak].get<int64_t>();
  const int64_t limit = (*b)[kPeak].get<int64_t>() + unit_bytes;
  t["block_param_bytes"] = unit_bytes;
  t["value"] = v;
  t["limit"] = limit;
  t["excess_over_fsdp_bytes"] = v - (*b)[kPeak].get<int64_t>();
  t["pass"] = v <= limit;
  return t;
}

// Our rows reuse the memory a step frees (hp/util/host_memory.h), so a
// steady step faults in next to no pages. Any block handed back to the
// kernel and allocated again costs all its pages: 512 for one 2 MiB
// attention buffer. So the limit, 64 pages per step, catches every returned
// block of 256 KiB or more while leaving room for stray small pages.
json page_faults_target(const json& rows) {
  constexpr double kLimit = 64;
  json t = {{"what",
             "minor page faults per timed step of each of our rows <= 64 (freed memory "
             "is reused, not faulted in again)"},
            {"limit", kLimit}};
  json each = json::object();
  double worst = 0;
  for (const auto& r : rows) {
    const std::string name = r["name"];
    if (find_row_spec(name).torch() || r.value("page_faults_per_step", json(nullptr)).is_null()) {
      continue;
    }
    each[name] = r["page_faults_per_step"];
    worst = std::max(worst, r["page_faults_per_step"].get<double>());
  }
  if (each.empty()) return unmeasured(t);
  t["value"] = worst;
  t["each_row"] = each;
  t["pass"] = worst <= kLimit;
  return t;
}

// The pipeline rows' schedule targets (docs/bench.md, "Pipeline rows"), on
// the configuration they are stated for: 8 blocks in 8 micro-batches over
// the 4 ranks (BenchConfig's pp_layers and pp_microbatches); another one
// still reports them, marked as such. Every one also says how many samples
// a micro-batch holds, which sets how far activations outweigh the state
// kept between steps and per-action costs outweigh compute.
json pipeline_target(json t, const BenchConfig& c) {
  t["stated_configuration"] = c.pp_layers == 8 && c.pp_microbatches == 8;
  t["samples_per_microbatch"] = c.batch / std::max<int64_t>(c.pp_microbatches, 1);
  return t;
}

const json* pipeline_of(const json& rows, const std::string& name) {
  const json* r = find_row(rows, name);
  if (!r || !r->contains("pipeline") ||
      (*r)["pipeline"].value("measured_bubble", json(nullptr)).is_null())
    return nullptr;
  return &(*r)["pipeline"];
}

// 1F1B's measured bubble at most 1.2x its theoretical fraction.
json pipeline_bubble_target(const json& rows, const BenchConfig& c) {
  json t = pipeline_target({{"what", "measured bubble of pp4 (1F1B) <= 1.2 x its theoretical "
                                     "fraction (p-1)/(m+p-1)"},
                            {"limit", 1.2}},
                           c);
  const json* p = pipeline_of(rows, "pp4");
  if (!p || p->value("theoretical_bubble", json(nullptr)).is_null()) return unmeasured(t);
  const double v =
      (*p)["measured_bubble"].get<double>() / (*p)["theoretical_bubble"].get<double>();
  t["value"] = v;
  t["pass"] = v <= 1.2;
  return t;
}

// An interleaved or zero-bubble row's measured bubble below 1F1B's.
json pipeline_bubble_below_1f1b_target(const json& rows, const std::string& name,
                                       const BenchConfig& c) {
  json t = pipeline_target({{"what", "measured bubble of " + name + " / pp4's (1F1B) < 1"},
                            {"limit", 1.0}},
                           c);
  const json* p = pipeline_of(rows, name);
  const json* base = pipeline_of(rows, "pp4");
  if (!p || !base) return unmeasured(t);
  const double v =
      (*p)["measured_bubble"].get<double>() / (*base)["measured_bubble"].get<double>();
  t["value"] = v;
  t["pass"] = v < 1.0;
  return t;
}

// 1F1B's peak at most two thirds of GPipe's on every rank: the highest of
// the ranks' ratios.
json pipeline_peak_target(const json& rows, const BenchConfig& c) {
  json t = pipeline_target({{"what", "peak of pp4 (1F1B) / pp4_gpipe's on the same rank, the "
                                     "highest over the ranks, <= 2/3"},
                            {"limit", 2.0 / 3}},
                           c);
  const json* ours = find_row(rows, "pp4");
  const json* gpipe = find_row(rows, "pp4_gpipe");
  const char* key = "peak_bytes_each_rank";
  if (!ours || !gpipe || !ours->contains(key) || !gpipe->contains(key) ||
      (*ours)[key].size() != (*gpipe)[key].size() || (*ours)[key].empty())
    return unmeasured(t);
  std::vector<double> each;
  for (size_t i = 0; i < (*ours)[key].size(); ++i)
    each.push_back((*ours)[key][i].get<double>() / (*gpipe)[key][i].get<double>());
  const double v = *std::max_element(each.begin(), each.end());
  t["value"] = v;
  t["each_rank"] = each;
  t["pass"] = v <= 2.0 / 3;
  return t;
}

}  // namespace

const std::vector<RatioTarget>& ratio_targets() { return kRatioTargets; }

json compute_targets(const json& rows, const BenchConfig& c) {
  json targets = json::object();
  for (const RatioTarget& t : kRatioTargets) targets[t.key] = ratio_target(rows, t);
  targets["activation_checkpointing_fsdp_ac_over_fsdp"] = activation_checkpointing_target(rows, c);
  const int64_t units = c.layers + 1;
  for (const auto& [name, hsdp] : {std::pair<std::string, bool>{"fsdp_fused", false},
                                    {"fsdp_fused_prefetch", false},
                                    {"hsdp_fused_prefetch", true}}) {
    targets["collectives_" + name] = fused_collectives_target(rows, name, hsdp, units);
  }
  const bool gpu = c.device == "cuda";
  for (const std::string name : {"fsdp_fused_prefetch", "ddp", "hsdp_fused_prefetch"}) {
    targets["exposed_comm_" + name] = exposed_comm_target(rows, name, gpu);
  }
  if (gpu) targets["gpu_world_of_one_fsdp_over_single"] = gpu_world_of_one_target(rows, c);
  targets["plan_vs_measured"] = plan_target(rows);
  targets["page_faults_per_step"] = page_faults_target(rows);
  for (const std::string name : {"fsdp_fused", "fsdp_fused_prefetch"}) {
    targets["peak_memory_" + name] = fused_peak_target(rows, name);
  }
  targets["pp4_bubble_over_theory"] = pipeline_bubble_target(rows, c);
  for (const std::string name : {"pp4_interleaved", "pp4_zero_bubble"})
    targets[name + "_bubble_over_pp4"] = pipeline_bubble_below_1f1b_target(rows, name, c);
  targets["pp4_peak_over_pp4_gpipe"] = pipeline_peak_target(rows, c);
  return targets;
}

std::string target_value(const json& target) {
  const json& value = target["value"];
  if (value.is_number()) {
    std::string text = fmt::format("{:.4g}", value.get<double>());
    if (target.contains("range")) {
      text += fmt::format(" [{:.3g}-{:.3g}]", target["range"][0].get<double>(),
                          target["range"][1].get<double>());
    }
    return text;
  }
  if (value.is_object() && value.contains("peak")) {
    return fmt::format("peak {:.3f} time {:.3f}", value["peak"].get<double>(),
                       value["step_time"].get<double>());
  }
  if (value.is_object()) {
    return fmt::format("AG {:.1f} RS {:.1f} AR {:.1f}", value["all_gather"].get<double>(),
                       value["reduce_scatter"].get<double>(), value["all_reduce"].get<double>());
  }
  return "-";
}

std::string target_verdict(const json& target) {
  if (target["pass"].is_null()) return "n/a ";
  return target["pass"].get<bool>() ? "PASS" : "FAIL";
}

}  // namespace hp::bench
