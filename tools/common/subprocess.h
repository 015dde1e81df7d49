// Running a program as a child process: its output captured (and optionally
// streamed line by line), its exit status, a time limit.
//
// hp-bench starts its rows and its plot this way, and the tests start hprun
// and hp-train this way. hprun has its own spawner (tools/hprun/spawn.h):
// supervising ranks is its product, with process groups and signal
// forwarding that a plain child does not need. Free of libtorch, like hprun.
#pragma once

#include <sys/types.h>

#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace hp::tools {

struct ProcessResult {
  int exit_code = -1;   // valid when exited
  int term_signal = 0;  // valid when killed by a signal
  bool exited = false;
  bool timed_out = false;  // did not end within the limit; it was SIGKILLed
  double seconds = 0;      // from start to exit
  std::string out;         // stdout (with merge_stderr: both, interleaved as written)
  std::string err;         // stderr (empty with merge_stderr)
};

// The status a shell would report: the exit code, or 128 + the signal.
int shell_status(const ProcessResult& result);
// "exit status 3", "killed by signal 9", "timed out after 2.0 s (killed)".
std::string describe_exit(const ProcessResult& result);

struct ProcessOptions {
  explicit ProcessOptions() = default;  // no brace-conversion from an env list

  // "NAME=value" entries added to this process's environment, overriding
  // inherited entries of the same name.
  std::vector<std::string> env;
  // stderr goes into the stdout pipe, so one stream keeps the order in which
  // the child wrote its lines.
  bool merge_stderr = false;
  // Called with each stdout line (without the newline) as it arrives, from
  // wait(); the last line is passed even without a newline.
  std::function<void(const std::string&)> on_line;
};

constexpr double kNoTimeLimit = std::numeric_limits<double>::infinity();

class RunningProcess {
 public:
  // Starts argv[0] (a path: no PATH search). When exec fails, the child
  // writes the reason to its stderr and exits with status 127. Throws
  // std::runtime_error when the pipes or the process cannot be created.
  explicit RunningProcess(const std::vector<std::string>& argv,
                          const std::vector<std::string>& env = {});
  RunningProcess(const std::vector<std::string>& argv, const ProcessOptions& options);
  // SIGKILLs and reaps a child that wait() was not called for.
  ~RunningProcess();

  RunningProcess(const RunningProcess&) = delete;
  RunningProcess& operator=(const RunningProcess&) = delete;

  pid_t pid() const { return pid_; }

  // Collects output until the process exits and its pipes close; SIGKILLs it
  // after limit_s. Call once.
  ProcessResult wait(double limit_s = 30);

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  int err_fd_ = -1;
  double started_ = 0;
  bool waited_ = false;
  std::function<void(const std::string&)> on_line_;
};

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::vector<std::string>& env = {}, double limit_s = 30);

// Monotonic clock in seconds.
double now_seconds();

}  // namespace hp::tools
