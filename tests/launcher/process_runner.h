// What the tests of hprun and hp-train need around real child processes:
// starting them (tools/common/subprocess.h), watching the processes they
// leave behind, and scratch directories.
#pragma once

#include <sys/types.h>

#include <string>

#include "tools/common/subprocess.h"

namespace hp::launcher::testing {

// Starting programs is tools/common's (hp-bench shares it); the tests use
// it under these names.
using tools::now_seconds;
using tools::ProcessResult;
using tools::run_process;
using tools::RunningProcess;

// How a process ended and everything it wrote, for a failed expectation.
std::string describe(const ProcessResult& result);

// The contents of /proc/<pid>/<name>, or "" once the process is gone. (A read
// of an exiting process's file fails with ESRCH, which std::ifstream turns
// into an exception, so a watcher racing an exit reads through this.)
std::string read_proc_file(pid_t pid, const std::string& name);

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
