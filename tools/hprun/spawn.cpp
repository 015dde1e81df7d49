#include "tools/hprun/spawn.h"

#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace hp::launcher {
namespace {

std::vector<char*> to_c_array(const std::vector<std::string>& strings) {
  std::vector<char*> array;
  array.reserve(strings.size() + 1);
  for (const std::string& s : strings) array.push_back(const_cast<char*>(s.c_str()));
  array.push_back(nullptr);
  return array;
}

void close_pair(int fds[2]) {
  if (fds[0] >= 0) ::close(fds[0]);
  if (fds[1] >= 0) ::close(fds[1]);
}

// Runs in the child between fork and exec; never returns.
[[noreturn]] void exec_rank(int rank, pid_t parent, int out_w, int err_w, char* const* argv,
                            char* const* envp) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  // hprun may have died before prctl took effect; then nobody would kill us.
  if (::getppid() != parent) ::_exit(1);

  int null_fd = ::open("/dev/null", O_RDONLY);
  if (null_fd >= 0 && null_fd != STDIN_FILENO) {
    ::dup2(null_fd, STDIN_FILENO);
    ::close(null_fd);
  }
  // hprun's stderr, kept only for the exec failure message (closed by exec).
  int report_fd = ::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
  ::dup2(out_w, STDOUT_FILENO);  // dup2 clears close-on-exec on the copies
  ::dup2(err_w, STDERR_FILENO);

  // Ignored dispositions (hprun ignores SIGPIPE) survive exec; handled ones
  // would not, but reset everything for clarity.
  for (int signo = 1; signo < NSIG; ++signo) {
    if (signo != SIGKILL && signo != SIGSTOP) ::signal(signo, SIG_DFL);
  }
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);

  ::execvpe(argv[0], argv, envp);

  int err = errno;
  if (report_fd >= 0) {
    char message[512];
    int n = std::snprintf(message, sizeof(message), "hprun: rank %d: cannot execute '%s': %s\n",
                          rank, argv[0], std::strerror(err));
    if (n > 0) {
      [[maybe_unused]] ssize_t w =
          ::write(report_fd, message, std::min(static_cast<size_t>(n), sizeof(message) - 1));
    }
  }
  ::_exit(err == ENOENT || err == ENOTDIR ? 127 : 126);
}

}  // namespace

RankProcess spawn_rank(int rank, const std::vector<std::string>& argv,
                       const std::vector<std::string>& env) {
  if (argv.empty()) throw std::invalid_argument("spawn_rank: empty argv");
  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
    int e = errno;
    close_pair(out);
    close_pair(err);
    throw std::runtime_error(std::string("cannot create pipes: ") + std::strerror(e));
  }
  // Only hprun's read ends are non-blocking; a rank writing faster than hprun
  // copies should block, not see EAGAIN.
  ::fcntl(out[0], F_SETFL, ::fcntl(out[0], F_GETFL) | O_NONBLOCK);
  ::fcntl(err[0], F_SETFL, ::fcntl(err[0], F_GETFL) | O_NONBLOCK);

  std::vector<char*> c_argv = to_c_array(argv);
  std::vector<char*> c_env = to_c_array(env);
  pid_t parent = ::getpid();

  // Blocked across fork so that no signal runs hprun's handler in the child,
  // where it would write into hprun's signal pipe.
  sigset_t all, previous;
  sigfillset(&all);
  ::sigprocmask(SIG_BLOCK, &all, &previous);
  pid_t pid = ::fork();
  if (pid == 0) exec_rank(rank, parent, out[1], err[1], c_argv.data(), c_env.data());
  int fork_errno = errno;
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);

  ::close(out[1]);
  ::close(err[1]);
  if (pid < 0) {
    ::close(out[0]);
    ::close(err[0]);
    throw std::runtime_error(std::string("fork failed: ") + std::strerror(fork_errno));
  }
  // Also done by the child; doing it here too means the group exists as soon
  // as fork returns, whichever process runs first. EACCES after the child's
  // exec is harmless.
  ::setpgid(pid, pid);
  return RankProcess{pid, out[0], err[0]};
}

}  // namespace hp::launcher
