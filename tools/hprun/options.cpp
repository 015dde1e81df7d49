#include "tools/hprun/options.h"

#include <CLI/CLI.hpp>

#include "tools/common/command_line.h"

#include <algorithm>
#include <cmath>
#include <memory>

namespace hp::launcher {
namespace {

// Each value is checked by a CLI11 validator before CLI11 converts it into
// its typed field, so every message has one shape: option, value,
// expectation. Plain decimal numbers only: CLI11's conversion alone would
// also take "0x10" or " 7".
bool is_decimal(const std::string& value) {
  return !value.empty() &&
         std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
}

CLI::Validator integer_in(long min, long max, const std::string& expected) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        // A decimal too long for a long saturates, so it still reads as
        // above max.
        long parsed = 0;
        if (!is_decimal(value) || !CLI::detail::lexical_cast(value, parsed) || parsed < min) {
          return "must be " + expected + ", got '" + value + "'";
        }
        if (parsed > max) return "must be at most " + std::to_string(max) + ", got '" + value + "'";
        return "";
      },
      "", "integer_in");
}

const CLI::Validator kSeconds(
    [](std::string& value) -> std::string {
      double parsed = 0;
      // A bound, not only finiteness: 1e10 s would overflow the clock's
      // nanoseconds when added to now (attempt.h's after()).
      const bool ok = !value.empty() && CLI::detail::lexical_cast(value, parsed) &&
                      std::isfinite(parsed) && parsed > 0 && parsed <= kMaxSeconds;
      return ok ? ""
                : "must be a positive number of seconds, at most " +
                      std::to_string(static_cast<long>(kMaxSeconds)) + " (a year), got '" + value +
                      "'";
    },
    "", "seconds");

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0;
}

constexpr const char* kUsage = "usage: hprun -n N [options] prog [args...]";

// CLI11's usage line knows nothing of the program that follows the options.
class Formatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: hprun -n N [OPTIONS] prog [args...]\n";
  }
};

}  // namespace

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CLI::App app{"Runs N local ranks of a program with torchrun-style environment variables.",
               "hprun"};
  app.formatter(std::make_shared<Formatter>());
  // prefix_command: parsing stops at the first positional argument and the
  // rest, option-like or not, is left in remaining() untouched.
  app.prefix_command();
  app.footer(
      "prog [args...] is started on every rank with RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GROUP_RANK and NODE_RANK set.\n"
      "TORCHELASTIC_RESTART_COUNT (0 on the first attempt) and TORCHELASTIC_MAX_RESTARTS\n"
      "tell a rank which attempt it belongs to.\n"
      "If a rank fails, the others are terminated; with restarts left every rank is\n"
      "started again (a fresh rendezvous), else hprun exits with the failed rank's status.\n"
      "With --nnodes K > 1, node 0's hprun serves the agents' rendezvous on\n"
      "--master-addr:--master-port and tells every node the ranks' port per attempt.\n");

  CommandLine result;
  LaunchOptions& o = result.options;
  bool no_prefix = false;
  auto* nproc = app.add_option("-n,--nproc-per-node", o.nproc_per_node,
                               "ranks to start on this node (required)")
                    ->type_name("N")
                    ->check(integer_in(1, 1 << 16, "a positive integer"));
  app.add_option("--nnodes", o.nnodes, "number of nodes (default 1)")
      ->type_name("K")
      ->check(integer_in(1, 1 << 16, "a positive integer"));
  app.add_option("--node-rank", o.node_rank, "rank of this node in [0, K) (default 0)")
      ->type_name("I")
      ->check(integer_in(0, 1 << 16, "a non-negative integer"));
  app.add_option("--master-addr", o.master_addr, "rendezvous host (default 127.0.0.1)")
      ->type_name("ADDR");
  auto* master_port =
      app.add_option("--master-port", o.master_port,
                     "rendezvous port (default: a free port; required with --nnodes > 1, where "
                     "it is node 0's agent store and the ranks get a port picked per attempt)")
          ->type_name("PORT")
          ->check(integer_in(1, 65535, "a port in 1..65535"));
  app.add_option("--max-restarts", o.max_restarts,
                 "after a failure, start every rank again up to this many times (default 0)")
      ->type_name("R")
      ->check(integer_in(0, 1 << 20, "a non-negative integer"));
  app.add_option("--rdzv-timeout", o.rdzv_timeout_s,
                 "with --nnodes > 1: how long node 0 waits for every node to join an attempt, "
                 "and other nodes to reach node 0 (default 300)")
      ->type_name("SECONDS")
      ->check(kSeconds);
  auto* rdzv_bind =
      app.add_option("--rdzv-bind", o.rdzv_bind,
                     "with --nnodes > 1: the IPv4 address node 0's agent listens on (default "
                     "127.0.0.1; 0.0.0.0 for every interface); required when --master-addr is "
                     "not a loopback address")
          ->type_name("ADDR")
          ->check(CLI::ValidIPV4);
  app.add_option("--rdzv-secret-file", o.rdzv_secret_file,
                 "with --nnodes > 1: a file (mode 0600) holding the job's secret, the same on "
                 "every node; without it, the secret is read from HPRUN_RDZV_SECRET")
      ->type_name("PATH");
  app.add_flag("--no-prefix", no_prefix, "do not prefix output lines with [rank r]");
  app.add_option("--timeout", o.timeout_s,
                 "terminate the job (SIGTERM, then SIGKILL after 3 s) after this many seconds, "
                 "counted across all attempts, "
                 "and exit with status 124, as timeout(1) does (default: no limit)")
      ->type_name("SECONDS")
      ->check(kSeconds);

  try {
    const tools::ParsedCommandLine parsed = tools::parse_command_line(app, args, kUsage);
    if (parsed.help_requested) {
      result.help_requested = true;
      result.help_text = parsed.help_text;
      return result;
    }
  } catch (const tools::CommandLineError& e) {
    // CLI11 names an option by its long name; usage and docs write -n.
    std::string message = e.what();
    const std::string nproc = "--nproc-per-node ";
    if (message.compare(0, nproc.size(), nproc) == 0) message.replace(0, nproc.size() - 1, "-n");
    throw UsageError(message);
  }

  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") {
    // "hprun -n 2 -- prog": CLI11 hands the separator through; it only
    // marks where the program starts.
    o.command.erase(o.command.begin());
  } else if (!o.command.empty() && o.command.front().size() > 1 && o.command.front()[0] == '-') {
    // prefix_command also collects unknown options that precede the program.
    throw UsageError("unknown option '" + o.command.front() + "'; " + kUsage);
  }
  if (nproc->count() == 0) throw UsageError(std::string("-n N is required; ") + kUsage);
  if (o.node_rank >= o.nnodes) {
    throw UsageError("--node-rank " + std::to_string(o.node_rank) +
                     " is out of range for --nnodes " + std::to_string(o.nnodes) +
                     " (expected 0.." + std::to_string(o.nnodes - 1) + ")");
  }
  if (o.master_addr.empty()) throw UsageError("--master-addr must not be empty");
  if (master_port->count() == 0 && o.nnodes > 1) {
    // A port picked here would be unknown to the other nodes.
    throw UsageError("--master-port is required with --nnodes " + std::to_string(o.nnodes) +
                     " (every node must be given the same port)");
  }
  if (o.nnodes > 1 && o.node_rank == 0 && rdzv_bind->count() == 0 &&
      !is_loopback(o.master_addr)) {
    // Listening on loopback, node 0 could not be reached at --master-addr;
    // listening everywhere is a choice the user makes (docs: README).
    throw UsageError("--master-addr " + o.master_addr +
                     " is not a loopback address: give node 0 --rdzv-bind with the address the "
                     "other nodes reach it at (or 0.0.0.0 for every interface)");
  }
  if (static_cast<long>(o.nnodes) * o.nproc_per_node > (1 << 24)) {
    throw UsageError("--nnodes " + std::to_string(o.nnodes) + " times -n " +
                     std::to_string(o.nproc_per_node) + " exceeds the largest world size " +
                     std::to_string(1 << 24));
  }
  o.prefix_output = !no_prefix;
  if (o.command.empty()) throw UsageError(std::string("missing the program to run; ") + kUsage);
  return result;
}

}  // namespace hp::launcher
