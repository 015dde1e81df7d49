// Summarising hp-bench's runs into the rows of its report (A2): one row's
// rounds pooled into step-time quantiles, tokens per second, memory and
// collectives; the row of one that failed or was skipped; and the checkpoint
// row's repeats. Pure functions of their arguments.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_config.h"
#include "bench/rows.h"

namespace hp::bench {

// Pools the rounds of one row (each a worker's result line) into its report row.
nlohmann::json summarize_row(const Row& row, const std::vector<nlohmann::json>& runs,
                             const BenchConfig& c);

// A row with no round measured: `skipped` is a result that says why it did not
// run (e.g. torch_fsdp2 without FSDP2); otherwise `error` says why it failed.
nlohmann::json skipped_row(const Row& row, const nlohmann::json& skipped, const BenchConfig& c);
nlohmann::json failed_row(const Row& row, const std::string& error, const BenchConfig& c);

// The checkpoint row's result with each phase's best (fastest) repeat, each
// repeat's ratios, and its targets: save and load at least 0.5x the plain
// write and read, peak extra memory during save at most the largest piece a
// rank holds (no gather of the model); in a training loop (C7) an
// asynchronous save's stall at most 0.1x a synchronous one's and the steps
// overlapping its write at most 1.15x the steps without a save (medians).
nlohmann::json summarize_checkpoint(nlohmann::json result);

}  // namespace hp::bench
