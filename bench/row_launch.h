// Launching hp-bench's jobs (A2): the command line of a row or of one of our
// workers under hprun, running it to completion, and finding its result line
// (kResultMarker) in its output. Runs one child at a time on the calling
// thread; launch failures are reported in the outcome, never thrown.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_config.h"
#include "bench/rows.h"
#include "tools/common/subprocess.h"

namespace hp::bench {

// What every command line is made of.
struct Launcher {
  std::string hprun;         // the launcher binary
  std::string self;          // this hp-bench binary, for --worker
  std::string python;        // for the PyTorch rows
  std::string baseline_dir;  // where the PyTorch baselines' scripts are
  int timeout_s = 180;       // one job's limit (hprun --timeout), before Row::timeout_multiple
};

// `hprun -n RANKS --timeout T hp-bench --worker WORKER <config flags>`.
std::vector<std::string> worker_command(const Launcher& l, const std::string& worker, int ranks,
                                        int timeout_s, const BenchConfig& c);

// The command that runs `row` once: our worker, or PYTHON SCRIPT for a PyTorch
// row (a pipeline row's also told its name and schedule: --row, --pp-schedule,
// --pp-stages-per-rank, --pp-data-parallel).
std::vector<std::string> row_command(const Launcher& l, const Row& row, const BenchConfig& c);

struct RunOutcome {
  bool ok = false;
  nlohmann::json result;  // the result line's object; null unless ok
  std::string error;      // why not ok, with the job's last lines of output
  double wall_s = 0;
};

// Runs argv (logged under `label`; its output echoed when verbose) and reads
// the last result line.
RunOutcome launch(const std::string& label, const std::vector<std::string>& argv, bool verbose);

// Runs argv to completion, its stdout and stderr merged into one stream of
// lines, each passed to on_line as it arrives. The rows bound their own time
// (hprun --timeout), so no limit is set here.
struct ChildOutcome {
  tools::ProcessResult result;
  std::vector<std::string> lines;
};
ChildOutcome run_child(const std::vector<std::string>& argv,
                       std::function<void(const std::string&)> on_line);

}  // namespace hp::bench
