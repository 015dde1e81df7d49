#include "tools/hprun/attempt.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <sstream>

#include "tools/hprun/exit_status.h"
#include "tools/hprun/line_prefixer.h"
#include "tools/hprun/rank_env.h"
#include "tools/hprun/spawn.h"
#include "tools/hprun/supervisor.h"

extern char** environ;

namespace hp::launcher {

void Sink::write(const std::string& data) {
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

void say(Sink& err, const std::string& line) { err.write("hprun: " + line + "\n"); }

std::string clock_text(double seconds) {
  long total = static_cast<long>(seconds < 0 ? 0 : seconds);
  char text[32];
  if (total >= 3600) {
    std::snprintf(text, sizeof(text), "%ld:%02ld:%02ld", total / 3600, total / 60 % 60,
                  total % 60);
  } else {
    std::snprintf(text, sizeof(text), "%02ld:%02ld", total / 60, total % 60);
  }
  return text;
}

std::string count_ranks(std::size_t n) {
  return std::to_string(n) + (n == 1 ? " rank" : " ranks");
}

std::string seconds_text(double s) {
  std::ostringstream text;
  text << s << " s";
  return text.str();
}

struct Attempt::Stream {
  int fd = -1;
  Sink* sink = nullptr;
  std::unique_ptr<LinePrefixer> lines;
};

// kExited: the leader has terminated but is deliberately left a zombie until
// the attempt ends. A zombie keeps its pid, hence its process group id, from
// being reused, so signalling -pid later can only reach the rank's own
// leftover children, never an unrelated process group.
enum class RankState { kRunning, kExited, kReaped };

struct Attempt::Rank {
  int global_rank = 0;
  pid_t pid = -1;
  RankState state = RankState::kRunning;
  int status = 0;  // waitpid()-style, valid once exited
  Stream out, err;
};

Clock::time_point after(Clock::time_point from, double seconds) {
  return from +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

int poll_wait_ms(std::optional<Clock::time_point> next) {
  long ms = 500;
  if (next) {
    auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(*next - Clock::now()).count() + 1;
    ms = std::clamp<long>(left, 0, ms);
  }
  return static_cast<int>(ms);
}

Attempt::Attempt(const LaunchOptions& options, const SupervisorConfig& config, Sink& out,
                 Sink& err, int master_port, int restart_count)
    : options_(options),
      config_(config),
      stdout_(out),
      stderr_(err),
      master_port_(master_port),
      restart_count_(restart_count) {}

Attempt::~Attempt() { finish(); }

void Attempt::start() {
  ranks_.reserve(static_cast<std::size_t>(options_.nproc_per_node));
  for (int local = 0; local < options_.nproc_per_node; ++local) {
    auto rank = std::make_unique<Rank>();
    rank->global_rank = options_.global_rank(local);
    std::vector<std::string> env =
        rank_environment(options_, master_port_, local, restart_count_, environ);
    try {
      RankProcess process = spawn_rank(rank->global_rank, options_.command, env);
      rank->pid = process.pid;
      std::string prefix =
          options_.prefix_output ? "[rank " + std::to_string(rank->global_rank) + "] " : "";
      rank->out = Stream{process.stdout_fd, &stdout_, std::make_unique<LinePrefixer>(prefix)};
      rank->err = Stream{process.stderr_fd, &stderr_, std::make_unique<LinePrefixer>(prefix)};
    } catch (const std::exception& e) {
      say(stderr_, "cannot start rank " + std::to_string(rank->global_rank) + ": " + e.what());
      setup_failed_ = true;
      if (!ranks_.empty()) {
        say(stderr_, "terminating the " + count_ranks(ranks_.size()) + " already started");
      }
      begin_teardown(SIGTERM);
      return;
    }
    ranks_.push_back(std::move(rank));
  }
}

void Attempt::append_fds(std::vector<pollfd>* fds) {
  polled_.clear();
  for (auto& rank : ranks_) {
    for (Stream* stream : {&rank->out, &rank->err}) {
      if (stream->fd < 0) continue;
      fds->push_back({stream->fd, POLLIN, 0});
      polled_.push_back(stream);
    }
  }
}

void Attempt::on_poll(const pollfd* fds) {
  for (std::size_t i = 0; i < polled_.size(); ++i) {
    // One read per stream per round keeps a chatty rank from starving the
    // others; poll() reports the rest next round.
    if (fds[i].revents != 0 && polled_[i]->fd >= 0) read_stream(*polled_[i], false);
  }
  polled_.clear();
}

void Attempt::check(Clock::time_point now) {
  // Checked every round, not only on SIGCHLD: cheap, and robust to a lost
  // signal byte.
  check_children();
  if (tearing_down_ && !killed_ && kill_at_ && now >= *kill_at_) {
    std::vector<const Rank*> left = running();
    if (!left.empty()) {
      say(stderr_, list_ranks(left) + " still running " + seconds_text(config_.kill_grace_s) +
                       " after " + signal_name(teardown_signal_) + "; sending SIGKILL");
    }
    kill_all();
  }
  if (killed_ && give_up_at_ && now >= *give_up_at_) {
    std::vector<const Rank*> left = running();
    if (!left.empty()) {
      say(stderr_, list_ranks(left) + " did not exit after SIGKILL; not waiting any longer");
      gave_up_ = true;
    }
  }
}

std::optional<Clock::time_point> Attempt::next_deadline() const {
  if (killed_) return give_up_at_;
  if (tearing_down_) return kill_at_;
  return std::nullopt;
}

void Attempt::read_stream(Stream& stream, bool until_empty) {
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

void Attempt::check_children() {
  for (auto& rank : ranks_) {
    if (rank->state != RankState::kRunning) continue;
    siginfo_t info{};
    // WNOWAIT: see RankState::kExited.
    int rc = ::waitid(P_PID, static_cast<id_t>(rank->pid), &info, WEXITED | WNOHANG | WNOWAIT);
    if (rc != 0) {
      if (errno == EINTR) continue;
      // ECHILD: someone else reaped it; nothing is known about how it ended.
      rank->state = RankState::kReaped;
      rank->status = 0xff << 8;
      on_rank_exit(*rank);
      continue;
    }
    if (info.si_pid == 0) continue;
    rank->state = RankState::kExited;
    rank->status = wait_status_from(info);
    on_rank_exit(*rank);
  }
}

void Attempt::on_rank_exit(Rank& rank) {
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
      say(stderr_, "rank " + std::to_string(rank.global_rank) + " (pid " +
                       std::to_string(rank.pid) + ") also " + describe_wait_status(rank.status));
    }
    return;
  }
  first_failure_code_ = exit_code_of(rank.status);
  failed_at_ = Clock::now();
  failure_ = "rank " + std::to_string(rank.global_rank) + " (pid " + std::to_string(rank.pid) +
             ") " + describe_wait_status(rank.status);
  say(stderr_, failure_);
  std::size_t others = running().size();
  if (others > 0) say(stderr_, "terminating " + count_ranks(others) + " still running");
  begin_teardown(SIGTERM);
}

void Attempt::on_signal(int signo) {
  if (!tearing_down_) {
    interrupted_by_ = signo;
    say(stderr_,
        "received " + signal_name(signo) + "; forwarding it to " + count_ranks(running().size()));
    begin_teardown(signo);
  } else if (!killed_) {
    say(stderr_, "received " + signal_name(signo) + " during shutdown; sending SIGKILL to " +
                     count_ranks(running().size()));
    kill_all();
  }
}

void Attempt::stop(const std::string& why) {
  if (tearing_down_) return;
  stopped_ = true;
  if (!why.empty()) say(stderr_, why);
  begin_teardown(SIGTERM);
}

bool Attempt::done() const { return gave_up_ || running().empty(); }

void Attempt::begin_teardown(int signo) {
  if (tearing_down_) return;
  tearing_down_ = true;
  teardown_signal_ = signo;
  signal_groups(signo);
  kill_at_ = after(Clock::now(), config_.kill_grace_s);
}

void Attempt::kill_all() {
  killed_ = true;
  signal_groups(SIGKILL);
  give_up_at_ = after(Clock::now(), config_.give_up_after_kill_s);
}

void Attempt::signal_groups(int signo) {
  for (const auto& rank : ranks_) {
    // ESRCH (the group is already empty) is the common, harmless case.
    if (rank->state != RankState::kReaped) ::kill(-rank->pid, signo);
  }
}

void Attempt::finish() {
  if (finished_) return;
  finished_ = true;
  // A torn-down attempt leaves nothing behind: whatever remains in the ranks'
  // groups (children that ignored SIGTERM) goes now, while the zombie leaders
  // still pin the group ids.
  if (tearing_down_) signal_groups(SIGKILL);
  for (auto& rank : ranks_) {
    for (Stream* stream : {&rank->out, &rank->err}) {
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
    if (rank->state == RankState::kExited) {
      while (::waitpid(rank->pid, nullptr, 0) < 0 && errno == EINTR) {
      }
      rank->state = RankState::kReaped;
    }
  }
}

bool Attempt::succeeded() const {
  return !setup_failed_ && !stopped_ && exit_code(1) == 0;
}

int Attempt::exit_code(int stopped_code) const {
  if (first_failure_code_ >= 0) return first_failure_code_;
  if (setup_failed_) return kExitSetupFailed;
  if (interrupted_by_ != 0) {
    bool all_clean = std::all_of(ranks_.begin(), ranks_.end(), [](const auto& r) {
      return r->state != RankState::kRunning && WIFEXITED(r->status) &&
             WEXITSTATUS(r->status) == 0;
    });
    // Ranks that caught the signal and exited 0 ended the job cleanly.
    return all_clean ? 0 : 128 + interrupted_by_;
  }
  if (stopped_) return stopped_code;
  return 0;
}

std::vector<const Attempt::Rank*> Attempt::running() const {
  std::vector<const Rank*> result;
  for (const auto& rank : ranks_) {
    if (rank->state == RankState::kRunning) result.push_back(rank.get());
  }
  return result;
}

// "rank 3", "ranks 0, 2"
std::string Attempt::list_ranks(const std::vector<const Rank*>& ranks) const {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(ranks[i]->global_rank);
  }
  return text;
}

}  // namespace hp::launcher
