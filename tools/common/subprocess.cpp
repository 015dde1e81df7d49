#include "tools/common/subprocess.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <stdexcept>

extern char** environ;

namespace hp::tools {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int shell_status(const ProcessResult& result) {
  if (result.exited) return result.exit_code;
  return 128 + result.term_signal;
}

std::string describe_exit(const ProcessResult& result) {
  if (result.timed_out) return fmt::format("timed out after {:.1f} s (killed)", result.seconds);
  if (result.exited) return fmt::format("exit status {}", result.exit_code);
  return fmt::format("killed by signal {}", result.term_signal);
}

RunningProcess::RunningProcess(const std::vector<std::string>& argv,
                               const std::vector<std::string>& env)
    : RunningProcess(argv, [&] {
        ProcessOptions options;
        options.env = env;
        return options;
      }()) {}

RunningProcess::RunningProcess(const std::vector<std::string>& argv, const ProcessOptions& options)
    : on_line_(options.on_line) {
  if (argv.empty()) throw std::runtime_error("RunningProcess: empty command");
  std::vector<std::string> full_env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const std::string& o : options.env) overridden |= o.substr(0, o.find('=')) == name;
    if (!overridden) full_env.push_back(entry);
  }
  full_env.insert(full_env.end(), options.env.begin(), options.env.end());

  // Everything the child touches is prepared before fork: after it, the
  // child may only make async-signal-safe calls.
  std::vector<char*> c_argv, c_env;
  for (const std::string& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
  c_argv.push_back(nullptr);
  for (const std::string& e : full_env) c_env.push_back(const_cast<char*>(e.c_str()));
  c_env.push_back(nullptr);
  const std::string exec_failed = "exec " + argv[0] + " failed: ";

  int out[2] = {-1, -1}, err[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0 || (!options.merge_stderr && ::pipe2(err, O_CLOEXEC) != 0)) {
    const std::string reason = std::strerror(errno);
    for (int fd : {out[0], out[1]}) {
      if (fd >= 0) ::close(fd);
    }
    throw std::runtime_error("RunningProcess: pipe: " + reason);
  }
  started_ = now_seconds();
  pid_ = ::fork();
  if (pid_ < 0) {
    const std::string reason = std::strerror(errno);
    for (int fd : {out[0], out[1], err[0], err[1]}) {
      if (fd >= 0) ::close(fd);
    }
    throw std::runtime_error("RunningProcess: fork: " + reason);
  }
  if (pid_ == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(options.merge_stderr ? out[1] : err[1], STDERR_FILENO);
    ::execve(c_argv[0], c_argv.data(), c_env.data());
    const char* reason = std::strerror(errno);
    (void)!::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
    (void)!::write(STDERR_FILENO, reason, std::strlen(reason));
    (void)!::write(STDERR_FILENO, "\n", 1);
    ::_exit(127);
  }
  ::close(out[1]);
  out_fd_ = out[0];
  if (!options.merge_stderr) {
    ::close(err[1]);
    err_fd_ = err[0];
  }
}

RunningProcess::~RunningProcess() {
  if (!waited_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  if (out_fd_ >= 0) ::close(out_fd_);
  if (err_fd_ >= 0) ::close(err_fd_);
}

ProcessResult RunningProcess::wait(double limit_s) {
  ProcessResult result;
  waited_ = true;
  const double deadline = started_ + limit_s;
  double exited_at = -1;
  size_t line_start = 0;  // of result.out: where the next unreported line starts
  auto report_lines = [&](bool flush) {
    if (!on_line_) return;
    for (size_t nl; (nl = result.out.find('\n', line_start)) != std::string::npos;
         line_start = nl + 1) {
      on_line_(result.out.substr(line_start, nl - line_start));
    }
    if (flush && line_start < result.out.size()) {
      on_line_(result.out.substr(line_start));
      line_start = result.out.size();
    }
  };
  char buffer[65536];
  for (;;) {
    std::vector<pollfd> fds;
    if (out_fd_ >= 0) fds.push_back({out_fd_, POLLIN, 0});
    if (err_fd_ >= 0) fds.push_back({err_fd_, POLLIN, 0});
    if (fds.empty() && exited_at >= 0) break;
    // After exit, whatever still holds the pipes gets 2 s to let go.
    if (exited_at >= 0 && now_seconds() > exited_at + 2) break;
    if (!fds.empty()) {
      ::poll(fds.data(), fds.size(), 20);
    } else {
      ::usleep(20 * 1000);
    }
    for (const pollfd& p : fds) {
      if (p.revents == 0) continue;
      ssize_t n = ::read(p.fd, buffer, sizeof(buffer));
      if (n > 0) {
        (p.fd == out_fd_ ? result.out : result.err).append(buffer, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        ::close(p.fd);
        (p.fd == out_fd_ ? out_fd_ : err_fd_) = -1;
      }
    }
    report_lines(/*flush=*/false);
    if (exited_at < 0) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        exited_at = now_seconds();
        result.seconds = exited_at - started_;
        result.exited = WIFEXITED(status);
        if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
        if (WIFSIGNALED(status)) result.term_signal = WTERMSIG(status);
      } else if (now_seconds() > deadline) {
        result.timed_out = true;
        ::kill(pid_, SIGKILL);
      }
    }
  }
  report_lines(/*flush=*/true);
  return result;
}

ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                          double limit_s) {
  RunningProcess process(argv, env);
  return process.wait(limit_s);
}

}  // namespace hp::tools
