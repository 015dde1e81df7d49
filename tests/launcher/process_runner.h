// Running a program (hprun, in these tests) as a real child process and
// capturing its stdout, stderr and exit status.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace hp::launcher::testing {

struct ProcessResult {
  int exit_code = -1;    // valid when exited
  int term_signal = 0;   // valid when killed by a signal
  bool exited = false;
  bool timed_out = false;  // did not end within the limit; it was SIGKILLed
  double seconds = 0;    // from start to exit
  std::string out;
  std::string err;
};

class RunningProcess {
 public:
  // Starts argv[0] (a path) with the test's environment plus `env`
  // ("NAME=value", overriding inherited entries of the same name).
  explicit RunningProcess(const std::vector<std::string>& argv,
                          const std::vector<std::string>& env = {});
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
};

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::vector<std::string>& env = {}, double limit_s = 30);

// Monotonic clock in seconds.
double now_seconds();

// True while `pid` exists and is not a zombie (an orphan's zombie may linger
// when the container's init does not reap).
bool process_alive(pid_t pid);

// Waits up to limit_s for `path` to hold an integer; returns it, or -1.
long wait_for_integer_file(const std::string& path, double limit_s);

// A fresh directory under the test temp dir, removed with its files when
// the object goes away.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

}  // namespace hp::launcher::testing
