#include "bench/row_launch.h"

#include <chrono>
#include <exception>
#include <filesystem>
#include <iostream>

namespace hp::bench {

using json = nlohmann::json;

namespace {

// "a b 'c d'" for logs.
std::string shell_words(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& a : argv) {
    if (!out.empty()) out += ' ';
    const bool plain = !a.empty() && a.find_first_of(" \t\n'\"\\$`*?;&|<>()") == std::string::npos;
    if (plain) {
      out += a;
    } else {
      out += '\'';
      for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
      out += '\'';
    }
  }
  return out;
}

// The JSON after the last kResultMarker; null if none, `error` set if unreadable.
json find_result(const std::vector<std::string>& lines, std::string& error) {
  const std::string marker = kResultMarker;
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    const size_t pos = it->find(marker);
    if (pos == std::string::npos) continue;
    try {
      return json::parse(it->substr(pos + marker.size()));
    } catch (const std::exception& e) {
      error = std::string("unreadable result line: ") + e.what();
      return json();
    }
  }
  return json();
}

std::vector<std::string> under_hprun(const Launcher& l, int ranks, int timeout_s) {
  return {l.hprun, "-n", std::to_string(ranks), "--timeout", std::to_string(timeout_s)};
}

void append(std::vector<std::string>& argv, const std::vector<std::string>& more) {
  argv.insert(argv.end(), more.begin(), more.end());
}

}  // namespace

std::vector<std::string> worker_command(const Launcher& l, const std::string& worker, int ranks,
                                        int timeout_s, const BenchConfig& c) {
  std::vector<std::string> argv = under_hprun(l, ranks, timeout_s);
  append(argv, {l.self, "--worker", worker});
  append(argv, c.worker_args());
  return argv;
}

std::vector<std::string> row_command(const Launcher& l, const Row& row, const BenchConfig& c) {
  const int timeout_s = l.timeout_s * row.timeout_multiple;
  if (!row.torch()) return worker_command(l, row.name, row.ranks(c), timeout_s, c);
  std::vector<std::string> argv = under_hprun(l, row.ranks(c), timeout_s);
  append(argv, {l.python, (std::filesystem::path(l.baseline_dir) / row.script).string()});
  append(argv, c.worker_args());
  // One script runs every PyTorch pipeline row: which one, and its schedule.
  if (const PipelineRow* pp = pipeline_row(row)) {
    append(argv, {"--row", row.name, "--pp-schedule", pp->schedule, "--pp-stages-per-rank",
                  std::to_string(pp->stages_per_rank), "--pp-data-parallel",
                  std::to_string(pp->data_parallel)});
  }
  return argv;
}

ChildOutcome run_child(const std::vector<std::string>& argv,
                       std::function<void(const std::string&)> on_line) {
  ChildOutcome child;
  tools::ProcessOptions options;
  options.merge_stderr = true;
  options.on_line = [&](const std::string& line) {
    child.lines.push_back(line);
    if (on_line) on_line(line);
  };
  tools::RunningProcess process(argv, options);
  child.result = process.wait(tools::kNoTimeLimit);
  return child;
}

RunOutcome launch(const std::string& label, const std::vector<std::string>& argv, bool verbose) {
  using Clock = std::chrono::steady_clock;
  RunOutcome outcome;
  std::cerr << "[hp-bench] " << label << ": " << shell_words(argv) << std::endl;
  const auto t0 = Clock::now();
  ChildOutcome child;
  try {
    child = run_child(argv, [&](const std::string& line) {
      if (verbose) std::cerr << "  | " << line << "\n";
    });
  } catch (const std::exception& e) {
    outcome.error = e.what();
    return outcome;
  }
  outcome.wall_s = std::chrono::duration<double>(Clock::now() - t0).count();
  outcome.result = find_result(child.lines, outcome.error);
  const int status = tools::shell_status(child.result);
  const std::string how = tools::describe_exit(child.result);
  if (status != 0 || outcome.result.is_null()) {
    std::string tail;
    const size_t from = child.lines.size() > 15 ? child.lines.size() - 15 : 0;
    for (size_t i = from; i < child.lines.size(); ++i) tail += child.lines[i] + "\n";
    outcome.error = (status != 0 ? how : std::string("no result line")) +
                    (outcome.error.empty() ? "" : "; " + outcome.error) + "; last output:\n" +
                    tail;
    outcome.result = json();
    std::cerr << "[hp-bench] " << label << " FAILED (" << how << ")\n" << tail;
    return outcome;
  }
  outcome.ok = true;
  return outcome;
}

}  // namespace hp::bench
