#include "tools/hprun/signal_pipe.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <stdexcept>
#include <string>

namespace hp::launcher {
namespace {

volatile sig_atomic_t g_write_fd = -1;

void on_signal(int signo) {
  int saved_errno = errno;
  unsigned char byte = static_cast<unsigned char>(signo);
  // Non-blocking: a full pipe drops the byte rather than deadlocking here.
  [[maybe_unused]] ssize_t n = ::write(g_write_fd, &byte, 1);
  errno = saved_errno;
}

}  // namespace

SignalPipe::SignalPipe(std::initializer_list<int> signals) : signals_(signals) {
  if (g_write_fd != -1) throw std::logic_error("only one SignalPipe may exist at a time");
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw std::runtime_error(std::string("cannot create the signal pipe: ") +
                             std::strerror(errno));
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  g_write_fd = write_fd_;
  for (int signo : signals_) {
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    // SA_RESTART keeps writes to stdout from failing with EINTR; poll() is
    // interrupted regardless, which is what wakes the loop.
    action.sa_flags = SA_RESTART | (signo == SIGCHLD ? SA_NOCLDSTOP : 0);
    struct sigaction old {};
    ::sigaction(signo, &action, &old);
    previous_.push_back(old);
  }
}

SignalPipe::~SignalPipe() {
  for (std::size_t i = 0; i < signals_.size(); ++i) {
    ::sigaction(signals_[i], &previous_[i], nullptr);
  }
  g_write_fd = -1;
  ::close(read_fd_);
  ::close(write_fd_);
}

std::vector<int> SignalPipe::drain() {
  std::vector<int> received;
  unsigned char buffer[64];
  for (;;) {
    ssize_t n = ::read(read_fd_, buffer, sizeof(buffer));
    if (n > 0) {
      received.insert(received.end(), buffer, buffer + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;  // EAGAIN: empty
  }
  return received;
}

}  // namespace hp::launcher
