// The driver side of hp-bench: launches every row (one after another, never
// two at once), collects their results, computes the target ratios and
// writes the table, the JSON and the plot.
#pragma once

#include <string>
#include <vector>

#include "bench/bench_config.h"

namespace hp::bench {

struct DriverOptions {
  BenchConfig config;     // config.steps is set per round from total_steps
  int64_t total_steps = 20;  // timed steps per row, over all rounds
  int rounds = 2;            // each row runs once per round; rounds interleave rows
  std::string json_path = "out/bench.json";
  std::string png_path;      // empty: no plot
  std::vector<std::string> rows;  // empty: all of row_names() (bench/rows.h)
  bool hook_overhead = true;
  bool dispatch_overhead = true;
  std::string hprun;         // default: next to this binary's build tree
  std::string python = HP_PYTHON;  // the build's (scripts/build.sh: the environment's)
  std::string torch_script;  // default: bench/torch_ddp_baseline.py of the source tree;
                             // every PyTorch row's script is taken from its directory
  std::string plot_script;   // default: bench/plot_bench.py of the source tree
  double row_timeout_s = 180;
  bool verbose = false;
};

// Returns 0 when every row, the hook measurement and the plot succeeded.
int run_driver(DriverOptions options);

}  // namespace hp::bench
