// Signals turned into bytes on a pipe (the self-pipe trick), so that the
// supervisor's poll() loop handles them like any other input instead of
// doing work inside a signal handler.
#pragma once

#include <csignal>
#include <initializer_list>
#include <vector>

namespace hp::launcher {

class SignalPipe {
 public:
  // Installs handlers for `signals`. Only one SignalPipe may exist at a time:
  // the handler finds the pipe through a process-wide variable.
  explicit SignalPipe(std::initializer_list<int> signals);
  // Restores the previous dispositions and closes the pipe.
  ~SignalPipe();

  SignalPipe(const SignalPipe&) = delete;
  SignalPipe& operator=(const SignalPipe&) = delete;

  // Readable whenever a signal has arrived since the last drain().
  int fd() const { return read_fd_; }

  // The signals received since the last call, oldest first. A burst that
  // overflows the pipe loses bytes; only SIGCHLD arrives in bursts and the
  // supervisor polls every child after each wake-up anyway.
  std::vector<int> drain();

 private:
  int read_fd_ = -1;
  int write_fd_ = -1;
  std::vector<int> signals_;
  std::vector<struct sigaction> previous_;
};

}  // namespace hp::launcher
