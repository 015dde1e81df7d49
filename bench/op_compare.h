// hp-bench --profile-ops (A2): our rows' per-op profiles next to their
// PyTorch peers'. Each profile is a file DIR/<row>.rank<r>.ops.json in the
// schema of hp::OpProfileResult::to_json() (per-step figures: "count",
// "self_cpu_time" and "cpu_time_total" in us) plus the row, rank, steps and
// source, written by our workers (write_ops_file) and, from torch.profiler,
// by bench/torch_baseline_common.py. Functions of their arguments and files,
// callable from any thread; in the comparison a missing file is no error
// (the pair is left out), an unreadable one is.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "hp/util/op_profile.h"

namespace hp::bench {

// What every profile file and the comparison say about the step times of
// the run that wrote them (bench/torch_baseline_common.py has the same text).
constexpr const char* kProfiledStepsNote =
    "step times of a run with --profile-ops include the profiler's cost: they are not the "
    "benchmark's";

// (our row, its PyTorch peer): single/torch_single, ddp/torch_ddp,
// fsdp_fused_prefetch/torch_fsdp2.
const std::vector<std::pair<std::string, std::string>>& op_compare_pairs();

// DIR/<row>.rank<rank>.ops.json.
std::string ops_file(const std::string& dir, const std::string& row, int rank);

// Writes `total` (the profile of `steps` timed steps), per step, to
// ops_file(dir, row, rank) with "row", "rank", "steps", "source": "hp" and
// the note. A file already there (an earlier round of the run: the driver
// clears DIR's profiles when it starts) is merged in (merge_per_step), so the
// file covers every round. Raises std::runtime_error when the file cannot be
// read or written.
void write_ops_file(const std::string& dir, const std::string& row, int rank, int64_t steps,
                    const OpProfileResult& total);

// Two per-step profiles (of a["steps"] and b["steps"] steps) as one of their
// summed steps: every figure the steps-weighted mean, an op missing on one
// side 0 there, allocations null when either side's are; the other fields
// are b's. ArgumentError when either lacks "steps" >= 1 or valid "ops".
nlohmann::json merge_per_step(const nlohmann::json& a, const nlohmann::json& b);

// One op on both sides, per step; an op one side never ran has 0 there.
struct OpDelta {
  std::string name;
  double ours_self_ms = 0;
  double torch_self_ms = 0;
  double ours_calls = 0;
  double torch_calls = 0;
  double diff_ms() const { return ours_self_ms - torch_self_ms; }
};

struct OpComparison {
  std::string ours_row, torch_row;
  std::vector<OpDelta> ops;  // every op of either side, by |diff_ms| largest first
  OpDelta totals;            // sums over all ops (name "total")
  // The profiles' "wall_us" per step in ms (profiler start to stop); -1 when absent.
  double ours_wall_ms = -1, torch_wall_ms = -1;
  // Our profile's "allocations" per step (torch.profiler counts none); -1 when null.
  double ours_allocations = -1;
};

// Pairs the ops of two per-step profiles by name. ArgumentError when either
// lacks an "ops" array of objects with name, count and self_cpu_time.
OpComparison compare_ops(const std::string& ours_row, const nlohmann::json& ours,
                         const std::string& torch_row, const nlohmann::json& theirs);

// The first `top` ops and the totals as a fixed-width table.
std::string format_comparison(const OpComparison& c, size_t top = 20);

// Every pair of op_compare_pairs() whose two rank-`rank` files exist in
// `dir`, formatted; "" when none does.
std::string compare_profile_dir(const std::string& dir, int rank = 0, size_t top = 20);

}  // namespace hp::bench
