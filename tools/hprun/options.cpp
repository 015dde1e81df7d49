#include "tools/hprun/options.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <memory>

namespace hp::launcher {
namespace {

// Options are read as strings and converted here rather than by CLI11, so
// every message has the same shape: option, value, expectation.
int parse_int(const std::string& option, const std::string& value, long min, long max,
              const char* expected) {
  char* end = nullptr;
  errno = 0;
  long parsed = std::strtol(value.c_str(), &end, 10);
  bool is_integer = !value.empty() && std::isdigit(static_cast<unsigned char>(value[0])) &&
                    *end == '\0' && errno == 0;
  if (is_integer && parsed > max) {
    throw UsageError(option + " must be at most " + std::to_string(max) + ", got '" + value +
                     "'");
  }
  if (!is_integer || parsed < min) {
    throw UsageError(option + " must be " + expected + ", got '" + value + "'");
  }
  return static_cast<int>(parsed);
}

double parse_seconds(const std::string& option, const std::string& value) {
  char* end = nullptr;
  errno = 0;
  double parsed = std::strtod(value.c_str(), &end);
  if (value.empty() || *end != '\0' || errno != 0 || !std::isfinite(parsed) || parsed <= 0) {
    throw UsageError(option + " must be a positive number of seconds, got '" + value + "'");
  }
  return parsed;
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
      "If a rank fails, the others are terminated and hprun exits with its status.\n");

  std::string nproc, nnodes, node_rank, master_port, timeout;
  std::string master_addr = "127.0.0.1";
  bool no_prefix = false;
  app.add_option("-n,--nproc-per-node", nproc, "ranks to start on this node (required)")
      ->type_name("N");
  app.add_option("--nnodes", nnodes, "number of nodes (default 1)")->type_name("K");
  app.add_option("--node-rank", node_rank, "rank of this node in [0, K) (default 0)")
      ->type_name("I");
  app.add_option("--master-addr", master_addr, "rendezvous host (default 127.0.0.1)")
      ->type_name("ADDR");
  app.add_option("--master-port", master_port,
                 "rendezvous port (default: a free port; required with --nnodes > 1)")
      ->type_name("PORT");
  app.add_flag("--no-prefix", no_prefix, "do not prefix output lines with [rank r]");
  app.add_option("--timeout", timeout, "terminate the job after this many seconds")
      ->type_name("SECONDS");

  CommandLine result;
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11's convention
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    result.help_requested = true;
    result.help_text = app.help();
    return result;
  } catch (const CLI::ParseError& e) {
    throw UsageError(std::string(e.what()) + "; " + kUsage);
  }

  LaunchOptions& o = result.options;
  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") {
    // "hprun -n 2 -- prog": CLI11 hands the separator through; it only
    // marks where the program starts.
    o.command.erase(o.command.begin());
  } else if (!o.command.empty() && o.command.front().size() > 1 && o.command.front()[0] == '-') {
    // prefix_command also collects unknown options that precede the program.
    throw UsageError("unknown option '" + o.command.front() + "'; " + kUsage);
  }
  if (nproc.empty()) throw UsageError(std::string("-n N is required; ") + kUsage);
  o.nproc_per_node = parse_int("-n", nproc, 1, 1 << 16, "a positive integer");
  if (!nnodes.empty()) o.nnodes = parse_int("--nnodes", nnodes, 1, 1 << 16, "a positive integer");
  if (!node_rank.empty()) {
    o.node_rank = parse_int("--node-rank", node_rank, 0, 1 << 16, "a non-negative integer");
  }
  if (o.node_rank >= o.nnodes) {
    throw UsageError("--node-rank " + node_rank + " is out of range for --nnodes " +
                     std::to_string(o.nnodes) + " (expected 0.." +
                     std::to_string(o.nnodes - 1) + ")");
  }
  if (master_addr.empty()) throw UsageError("--master-addr must not be empty");
  o.master_addr = master_addr;
  if (!master_port.empty()) {
    o.master_port = parse_int("--master-port", master_port, 1, 65535, "a port in 1..65535");
  } else if (o.nnodes > 1) {
    // A port picked here would be unknown to the other nodes.
    throw UsageError("--master-port is required with --nnodes " + std::to_string(o.nnodes) +
                     " (every node must be given the same port)");
  }
  if (static_cast<long>(o.nnodes) * o.nproc_per_node > (1 << 24)) {
    throw UsageError("--nnodes " + std::to_string(o.nnodes) + " times -n " +
                     std::to_string(o.nproc_per_node) + " exceeds the largest world size " +
                     std::to_string(1 << 24));
  }
  o.prefix_output = !no_prefix;
  if (!timeout.empty()) o.timeout_s = parse_seconds("--timeout", timeout);
  if (o.command.empty()) throw UsageError(std::string("missing the program to run; ") + kUsage);
  return result;
}

}  // namespace hp::launcher
