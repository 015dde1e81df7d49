#include "tests/launcher/process_runner.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace hp::launcher::testing {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

RunningProcess::RunningProcess(const std::vector<std::string>& argv,
                               const std::vector<std::string>& env) {
  std::vector<std::string> full_env;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    std::string name = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const std::string& o : env) overridden |= o.substr(0, o.find('=')) == name;
    if (!overridden) full_env.push_back(entry);
  }
  full_env.insert(full_env.end(), env.begin(), env.end());

  std::vector<char*> c_argv, c_env;
  for (const std::string& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
  c_argv.push_back(nullptr);
  for (const std::string& e : full_env) c_env.push_back(const_cast<char*>(e.c_str()));
  c_env.push_back(nullptr);

  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    throw std::runtime_error("pipe failed");
  }
  started_ = now_seconds();
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execve(c_argv[0], c_argv.data(), c_env.data());
    ::_exit(126);
  }
  ::close(out[1]);
  ::close(err[1]);
  out_fd_ = out[0];
  err_fd_ = err[0];
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
  double deadline = started_ + limit_s;
  double exited_at = -1;
  char buffer[65536];
  for (;;) {
    std::vector<pollfd> fds;
    if (out_fd_ >= 0) fds.push_back({out_fd_, POLLIN, 0});
    if (err_fd_ >= 0) fds.push_back({err_fd_, POLLIN, 0});
    if (fds.empty() && exited_at >= 0) break;
    // After exit, whatever still holds the pipes gets 2 s to let go.
    if (exited_at >= 0 && now_seconds() > exited_at + 2) break;
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 20);
    else ::usleep(20 * 1000);
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
  return result;
}

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::vector<std::string>& env, double limit_s) {
  RunningProcess process(argv, env);
  return process.wait(limit_s);
}

bool process_alive(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == EPERM;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::size_t close_paren = content.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= content.size()) return false;
  char state = content[close_paren + 2];
  return state != 'Z' && state != 'X';
}

long wait_for_integer_file(const std::string& path, double limit_s) {
  double deadline = now_seconds() + limit_s;
  do {
    std::ifstream in(path);
    long value = -1;
    // A file being written may still be empty or hold a partial number;
    // writers end the line, so wait for the newline.
    std::string line;
    if (in && std::getline(in, line) && !in.eof()) {
      char* end = nullptr;
      value = std::strtol(line.c_str(), &end, 10);
      if (!line.empty() && *end == '\0') return value;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (now_seconds() < deadline);
  return -1;
}

TempDir::TempDir() {
  std::string base = std::filesystem::temp_directory_path().string() + "/hprun_test.XXXXXX";
  std::vector<char> name(base.begin(), base.end());
  name.push_back('\0');
  if (::mkdtemp(name.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = name.data();
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace hp::launcher::testing
