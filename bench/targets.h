// hp-bench's targets (A2): what the benchmark aims for, computed from the
// report's rows, each with its limit and pass (true, false, or null when a
// row it needs did not run). Pure functions of their arguments.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_config.h"

namespace hp::bench {

// A target that is one row's figure over another's, at most `limit`. A
// step-time ratio also reports each round's ratio ("per_round"), their
// "range", and whether every round agrees with the verdict ("conclusive").
struct RatioTarget {
  const char* key;          // its name in the report's "targets"
  const char* numerator;    // row names
  const char* denominator;
  const char* metric;       // the row field compared: step_time_s_median or peak_bytes_per_rank
  double limit;
  const char* what;         // the target in words
};

// The ratio targets, as data.
const std::vector<RatioTarget>& ratio_targets();

// Every target of a run, by name, from its report rows.
nlohmann::json compute_targets(const nlohmann::json& rows, const BenchConfig& c);

// A target's value in a few words: a ratio (with its rounds' range, when
// it has one), peak and time, or collectives; "-" when unmeasured.
std::string target_value(const nlohmann::json& target);

// "PASS", "FAIL", or "n/a " (the target could not be measured).
std::string target_verdict(const nlohmann::json& target);

}  // namespace hp::bench
