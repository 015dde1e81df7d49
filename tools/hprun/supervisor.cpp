#include "tools/hprun/supervisor.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tools/hprun/exit_status.h"
#include "tools/hprun/free_port.h"
#include "tools/hprun/line_prefixer.h"
#include "tools/hprun/rank_env.h"
#include "tools/hprun/signal_pipe.h"
#include "tools/hprun/spawn.h"

extern char** environ;

namespace hp::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// One of hprun's own output streams. Once its reader is gone (EPIPE) the
// output is dropped, but the ranks' pipes are still drained so that no rank
// blocks on a full pipe.
class Sink {
 public:
  explicit Sink(int fd) : fd_(fd) {}

  void write(const std::string& data) {
    std::size_t done = 0;
    while (!broken_ && done < data.size()) {
      ssize_t n = ::write(fd_, data.data() + done, data.size() - done);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && errno == EAGAIN) {  // someone made our stdout non-blocking
        pollfd p{fd_, POLLOUT, 0};
        ::poll(&p, 1, 100);
      } else {
        broken_ = true;
      }
    }
  }

 private:
  int fd_;
  bool broken_ = false;
};

struct Stream {
  int fd = -1;
  Sink* sink = nullptr;
  std::unique_ptr<LinePrefixer> lines;
};

// kExited: the leader has terminated but is deliberately left a zombie until
// the job ends. A zombie keeps its pid, hence its process group id, from
// being reused, so signalling -pid later can only reach the rank's own
// leftover children, never an unrelated process group.
enum class State { kRunning, kExited, kReaped };

struct Rank {
  int global_rank = 0;
  pid_t pid = -1;
  State state = State::kRunning;
  int status = 0;  // waitpid()-style, valid once exited
  Stream out, err;
};

std::string count_ranks(std::size_t n) {
  return std::to_string(n) + (n == 1 ? " rank" : " ranks");
}

std::string seconds_text(double s) {
  std::ostringstream text;
  text << s << " s";
  return text.str();
}

class Job {
 public:
  Job(const LaunchOptions& options, const SupervisorConfig& config)
      : options_(options), config_(config), stdout_(STDOUT_FILENO), stderr_(STDERR_FILENO) {}

  int run();

 private:
  bool start_ranks();
  void poll_once(SignalPipe& signals);
  int poll_timeout_ms(Clock::time_point now) const;
  void read_stream(Stream& stream, bool until_empty);
  void check_children();
  void on_rank_exit(Rank& rank);
  void on_signal(int signo);
  void check_deadlines(Clock::time_point now);
  void begin_teardown(int signo);
  void kill_all();
  void signal_groups(int signo);
  void finish();
  int exit_code() const;

  std::vector<const Rank*> running() const;
  std::string list_ranks(const std::vector<const Rank*>& ranks) const;
  void say(const std::string& line) { stderr_.write("hprun: " + line + "\n"); }

  const LaunchOptions& options_;
  const SupervisorConfig& config_;
  Sink stdout_;
  Sink stderr_;
  std::vector<Rank> ranks_;
  std::vector<char> buffer_ = std::vector<char>(1 << 16);

  bool setup_failed_ = false;
  bool timed_out_ = false;
  int interrupted_by_ = 0;       // signal hprun received, if any
  int first_failure_code_ = -1;  // exit code of the first rank that failed
  bool tearing_down_ = false;
  int teardown_signal_ = SIGTERM;  // what begin_teardown sent: SIGTERM, or the SIGINT forwarded
  bool killed_ = false;
  bool gave_up_ = false;
  std::optional<Clock::time_point> job_deadline_, kill_at_, give_up_at_;
};

int Job::run() {
  // A vanished reader of our stdout must not kill hprun (and with it, via
  // PDEATHSIG, every rank); Sink drops the output instead.
  struct sigaction ignore {}, previous_sigpipe {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &previous_sigpipe);
  {
    // Installed before the first fork, so a signal can never find a rank
    // started but not yet known to the loop.
    SignalPipe signals({SIGINT, SIGTERM, SIGCHLD});
    if (options_.timeout_s > 0) {
      job_deadline_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(options_.timeout_s));
    }
    if (start_ranks()) {
      while (!gave_up_ && !running().empty()) poll_once(signals);
    }
    finish();
  }
  ::sigaction(SIGPIPE, &previous_sigpipe, nullptr);
  return exit_code();
}

bool Job::start_ranks() {
  int port = options_.master_port;
  if (port == 0) {
    try {
      port = pick_free_port();
    } catch (const std::exception& e) {
      say(e.what());
      setup_failed_ = true;
      return false;
    }
  }
  ranks_.reserve(static_cast<std::size_t>(options_.nproc_per_node));
  for (int local = 0; local < options_.nproc_per_node; ++local) {
    Rank rank;
    rank.global_rank = options_.global_rank(local);
    std::vector<std::string> env = rank_environment(options_, port, local, environ);
    try {
      RankProcess process = spawn_rank(rank.global_rank, options_.command, env);
      rank.pid = process.pid;
      std::string prefix =
          options_.prefix_output ? "[rank " + std::to_string(rank.global_rank) + "] " : "";
      rank.out = Stream{process.stdout_fd, &stdout_, std::make_unique<LinePrefixer>(prefix)};
      rank.err = Stream{process.stderr_fd, &stderr_, std::make_unique<LinePrefixer>(prefix)};
    } catch (const std::exception& e) {
      say("cannot start rank " + std::to_string(rank.global_rank) + ": " + e.what());
      setup_failed_ = true;
      if (!ranks_.empty()) say("terminating the " + count_ranks(ranks_.size()) + " already started");
      begin_teardown(SIGTERM);
      return !ranks_.empty();
    }
    ranks_.push_back(std::move(rank));
  }
  return true;
}

void Job::poll_once(SignalPipe& signals) {
  std::vector<pollfd> fds{{signals.fd(), POLLIN, 0}};
  std::vector<Stream*> streams{nullptr};
  for (Rank& rank : ranks_) {
    for (Stream* stream : {&rank.out, &rank.err}) {
      if (stream->fd < 0) continue;
      fds.push_back({stream->fd, POLLIN, 0});
      streams.push_back(stream);
    }
  }
  int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(Clock::now()));
  if (ready > 0) {
    if (fds[0].revents != 0) {
      for (int signo : signals.drain()) {
        if (signo == SIGINT || signo == SIGTERM) on_signal(signo);
      }
    }
    for (std::size_t i = 1; i < fds.size(); ++i) {
      // One read per stream per round keeps a chatty rank from starving the
      // others; poll() reports the rest next round.
      if (fds[i].revents != 0 && streams[i]->fd >= 0) read_stream(*streams[i], false);
    }
  }
  // Checked every round, not only on SIGCHLD: cheap, and robust to a lost
  // signal byte.
  check_children();
  check_deadlines(Clock::now());
}

int Job::poll_timeout_ms(Clock::time_point now) const {
  std::optional<Clock::time_point> next;
  if (!tearing_down_) next = job_deadline_;
  if (tearing_down_ && !killed_) next = kill_at_;
  if (killed_) next = give_up_at_;
  // The cap only bounds the damage of a missed wake-up.
  long ms = 500;
  if (next) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*next - now).count() + 1;
    ms = std::clamp<long>(left, 0, ms);
  }
  return static_cast<int>(ms);
}

void Job::read_stream(Stream& stream, bool until_empty) {
  // A drain is bounded: a leftover child writing without pause must not keep
  // hprun here. What an exited rank wrote fits in its pipe, far below this.
  int reads_left = until_empty ? 64 : 1;
  for (;;) {
    ssize_t n = ::read(stream.fd, buffer_.data(), buffer_.size());
    if (n > 0) {
      std::string lines;
      stream.lines->feed(buffer_.data(), static_cast<std::size_t>(n), &lines);
      stream.sink->write(lines);
      if (--reads_left == 0) return;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    // End of stream (or a read error, treated alike): the last line may lack
    // its newline.
    std::string tail;
    stream.lines->finish(&tail);
    stream.sink->write(tail);
    ::close(stream.fd);
    stream.fd = -1;
    return;
  }
}

void Job::check_children() {
  for (Rank& rank : ranks_) {
    if (rank.state != State::kRunning) continue;
    siginfo_t info{};
    // WNOWAIT: see State::kExited.
    int rc = ::waitid(P_PID, static_cast<id_t>(rank.pid), &info, WEXITED | WNOHANG | WNOWAIT);
    if (rc != 0) {
      if (errno == EINTR) continue;
      // ECHILD: someone else reaped it; nothing is known about how it ended.
      rank.state = State::kReaped;
      rank.status = 0xff << 8;
      on_rank_exit(rank);
      continue;
    }
    if (info.si_pid == 0) continue;
    rank.state = State::kExited;
    rank.status = wait_status_from(info);
    on_rank_exit(rank);
  }
}

void Job::on_rank_exit(Rank& rank) {
  // Its last output first, so that it precedes hprun's verdict on it.
  for (Stream* stream : {&rank.out, &rank.err}) {
    if (stream->fd >= 0) read_stream(*stream, true);
  }
  bool failed = !(WIFEXITED(rank.status) && WEXITSTATUS(rank.status) == 0);
  if (!failed) return;
  if (tearing_down_) {
    // Teardown casualties (killed by our signals) are not reported. A rank
    // that exited on its own with an error while a failure was being handled
    // may be the actual cause: ranks fail close together (a dying rank closes
    // its sockets before its process is gone, and its peers' collectives fail
    // at once), so which one hprun sees first is a matter of scheduling.
    if (first_failure_code_ >= 0 && WIFEXITED(rank.status)) {
      say("rank " + std::to_string(rank.global_rank) + " (pid " + std::to_string(rank.pid) +
          ") also " + describe_wait_status(rank.status));
    }
    return;
  }
  first_failure_code_ = exit_code_of(rank.status);
  say("rank " + std::to_string(rank.global_rank) + " (pid " + std::to_string(rank.pid) + ") " +
      describe_wait_status(rank.status));
  std::size_t others = running().size();
  if (others > 0) say("terminating " + count_ranks(others) + " still running");
  begin_teardown(SIGTERM);
}

void Job::on_signal(int signo) {
  if (!tearing_down_) {
    interrupted_by_ = signo;
    say("received " + signal_name(signo) + "; forwarding it to " + count_ranks(running().size()));
    begin_teardown(signo);
  } else if (!killed_) {
    say("received " + signal_name(signo) + " during shutdown; sending SIGKILL to " +
        count_ranks(running().size()));
    kill_all();
  }
}

void Job::check_deadlines(Clock::time_point now) {
  if (!tearing_down_ && job_deadline_ && now >= *job_deadline_) {
    timed_out_ = true;
    say("the job ran longer than --timeout " + seconds_text(options_.timeout_s) +
        "; terminating " + count_ranks(running().size()));
    begin_teardown(SIGTERM);
  }
  if (tearing_down_ && !killed_ && kill_at_ && now >= *kill_at_) {
    std::vector<const Rank*> left = running();
    if (!left.empty()) {
      say(list_ranks(left) + " still running " + seconds_text(config_.kill_grace_s) +
          " after " + signal_name(teardown_signal_) + "; sending SIGKILL");
    }
    kill_all();
  }
  if (killed_ && give_up_at_ && now >= *give_up_at_) {
    std::vector<const Rank*> left = running();
    if (!left.empty()) {
      say(list_ranks(left) + " did not exit after SIGKILL; not waiting any longer");
      gave_up_ = true;
    }
  }
}

void Job::begin_teardown(int signo) {
  if (tearing_down_) return;
  tearing_down_ = true;
  teardown_signal_ = signo;
  signal_groups(signo);
  kill_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(config_.kill_grace_s));
}

void Job::kill_all() {
  killed_ = true;
  signal_groups(SIGKILL);
  give_up_at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(config_.give_up_after_kill_s));
}

void Job::signal_groups(int signo) {
  for (const Rank& rank : ranks_) {
    // ESRCH (the group is already empty) is the common, harmless case.
    if (rank.state != State::kReaped) ::kill(-rank.pid, signo);
  }
}

void Job::finish() {
  // A torn-down job leaves nothing behind: whatever remains in the ranks'
  // groups (children that ignored SIGTERM) goes now, while the zombie leaders
  // still pin the group ids.
  if (tearing_down_) signal_groups(SIGKILL);
  for (Rank& rank : ranks_) {
    for (Stream* stream : {&rank.out, &rank.err}) {
      if (stream->fd < 0) continue;
      read_stream(*stream, true);
      if (stream->fd < 0) continue;
      // Still open: a leftover child of a rank holds the pipe. Its output
      // from now on is lost; what came before is flushed.
      std::string tail;
      stream->lines->finish(&tail);
      stream->sink->write(tail);
      ::close(stream->fd);
      stream->fd = -1;
    }
    if (rank.state == State::kExited) {
      while (::waitpid(rank.pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      rank.state = State::kReaped;
    }
  }
}

int Job::exit_code() const {
  if (first_failure_code_ >= 0) return first_failure_code_;
  if (setup_failed_) return kExitSetupFailed;
  if (timed_out_) return kExitTimeout;
  if (interrupted_by_ != 0) {
    bool all_clean = std::all_of(ranks_.begin(), ranks_.end(), [](const Rank& r) {
      return r.state != State::kRunning && WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
    });
    // Ranks that caught the signal and exited 0 ended the job cleanly.
    return all_clean ? 0 : 128 + interrupted_by_;
  }
  return 0;
}

std::vector<const Rank*> Job::running() const {
  std::vector<const Rank*> result;
  for (const Rank& rank : ranks_) {
    if (rank.state == State::kRunning) result.push_back(&rank);
  }
  return result;
}

// "rank 3", "ranks 0, 2"
std::string Job::list_ranks(const std::vector<const Rank*>& ranks) const {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]->global_rank);
  }
  return text;
}

}  // namespace

int run_job(const LaunchOptions& options, const SupervisorConfig& config) {
  return Job(options, config).run();
}

}  // namespace hp::launcher
