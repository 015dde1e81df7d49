// The command line of hprun.
//
//   hprun -n N [--nnodes K --node-rank I --master-addr A --master-port P
//               --rdzv-bind ADDR --rdzv-secret-file PATH]
//         [--max-restarts R] [--rdzv-timeout SECONDS]
//         [--no-prefix] [--timeout SECONDS] prog [args...]
//
// The first non-option argument is the program. It and everything after it
// form the ranks' argv verbatim, so "--gtest_filter=..." or "-n 3" after the
// program reach the program, not hprun. A bad value raises UsageError whose
// message names the option, the value and what was expected; main() turns it
// into exit status 2 before any process is started.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace hp::launcher {

struct LaunchOptions {
  int nproc_per_node = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: pick a free port (one node); with K > 1: node 0's agent store
  bool prefix_output = true;  // "[rank r] " before every line
  double timeout_s = 0;       // 0: no limit on the job's wall time, across all attempts
  int max_restarts = 0;       // attempts after the first one that failed
  double rdzv_timeout_s = 300;  // --nnodes > 1: how long node 0 waits for every agent
  // --nnodes > 1: where node 0's agent listens (IPv4; loopback unless asked).
  std::string rdzv_bind = "127.0.0.1";
  // --nnodes > 1: the job's secret (agent_protocol.h); empty: HPRUN_RDZV_SECRET.
  std::string rdzv_secret_file;
  std::vector<std::string> command;  // program, then its arguments

  int world_size() const { return nnodes * nproc_per_node; }
  int global_rank(int local_rank) const { return node_rank * nproc_per_node + local_rank; }
};

// The longest --timeout and --rdzv-timeout: a year, far below what the
// steady clock's nanoseconds can add without overflowing (~292 years).
constexpr double kMaxSeconds = 365.0 * 24 * 3600;

// hprun's exit status for a usage error, as with most Unix tools.
constexpr int kExitUsage = 2;

class UsageError : public std::invalid_argument {
 public:
  explicit UsageError(const std::string& what) : std::invalid_argument(what) {}
};

struct CommandLine {
  bool help_requested = false;  // -h/--help: print help_text, exit 0
  std::string help_text;
  LaunchOptions options;
};

// args excludes argv[0]. Throws UsageError.
CommandLine parse_command_line(const std::vector<std::string>& args);

}  // namespace hp::launcher
