// One attempt of a job on this node: the local ranks' lifetime from spawn to
// the last exit.
//
// An Attempt starts every local rank, copies their output line by line onto
// hprun's stdout/stderr and watches them. The first rank to fail (non-zero
// exit or death by signal) is reported on stderr, e.g.
//   hprun: rank 1 (pid 1234) exited with status 3
// and the attempt is torn down: SIGTERM to every rank's process group,
// SIGKILL after a grace period, so that no peer keeps waiting on a dead rank.
// Ranks that die from the teardown are not reported; the first failure is the
// cause, and ranks that exit with an error on their own meanwhile are listed
// after it ("rank 3 (pid 99) also exited with status 1"). A forwarded
// SIGINT/SIGTERM starts the same teardown; a second one sends SIGKILL at once.
//
// The Attempt owns no loop: its owner polls the fds it appends together with
// its own (signals, other nodes), then calls on_poll() and check(). Whether
// another attempt follows is the owner's decision (supervisor.h). Not
// thread-safe; the process must have no other code waiting for children.
#pragma once

#include <poll.h>
#include <sys/types.h>

#include <chrono>
#include <csignal>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tools/hprun/options.h"

namespace hp::launcher {

class LinePrefixer;
struct SupervisorConfig;

using Clock = std::chrono::steady_clock;

// `from` plus `seconds`.
Clock::time_point after(Clock::time_point from, double seconds);

// How long poll() may sleep to wake at `next` (none: no deadline). At most
// 500 ms: the cap only bounds the damage of a missed wake-up.
int poll_wait_ms(std::optional<Clock::time_point> next);

// One of hprun's own output streams, shared by all attempts. Once its reader
// is gone (EPIPE) the output is dropped, but the ranks' pipes are still
// drained so that no rank blocks on a full pipe.
class Sink {
 public:
  explicit Sink(int fd) : fd_(fd) {}
  void write(const std::string& data);

 private:
  int fd_;
  bool broken_ = false;
};

// hprun's own messages: "hprun: <line>" on stderr.
void say(Sink& err, const std::string& line);

// Elapsed time as "mm:ss", or "h:mm:ss" from an hour on.
std::string clock_text(double seconds);

// "1 rank", "3 ranks".
std::string count_ranks(std::size_t n);

// "3 s", "0.5 s".
std::string seconds_text(double s);

class Attempt {
 public:
  // `master_port` and `restart_count` go into every rank's environment.
  Attempt(const LaunchOptions& options, const SupervisorConfig& config, Sink& out, Sink& err,
          int master_port, int restart_count);
  ~Attempt();
  Attempt(const Attempt&) = delete;
  Attempt& operator=(const Attempt&) = delete;

  // Spawns the ranks. If one cannot be started, the ones already started are
  // torn down and setup_failed() is true.
  void start();

  // Appends the fds to poll; on_poll gets the same range back after poll().
  void append_fds(std::vector<pollfd>* fds);
  void on_poll(const pollfd* fds);
  // Children's exits and the teardown's deadlines; call after every poll().
  void check(Clock::time_point now);
  // When check() has something to do next, if ever.
  std::optional<Clock::time_point> next_deadline() const;

  // SIGINT/SIGTERM that hprun received: forwarded, teardown; a second one
  // during the teardown sends SIGKILL.
  void on_signal(int signo);
  // Teardown for a reason outside the ranks (--timeout, another node).
  // `why` is said first unless empty.
  void stop(const std::string& why);

  // No rank is left running (or one is stuck past SIGKILL).
  bool done() const;
  // Reaps the ranks and flushes their output; call once done().
  void finish();

  bool failed() const { return first_failure_code_ >= 0; }
  // "rank 2 (pid 1234) was killed by signal 9 (SIGKILL)"; valid if failed().
  const std::string& failure() const { return failure_; }
  Clock::time_point failed_at() const { return failed_at_; }
  bool setup_failed() const { return setup_failed_; }
  int interrupted_by() const { return interrupted_by_; }
  bool succeeded() const;
  // The attempt's exit code: 0 when every rank exited 0; the first failed
  // rank's code; 128 + signal number when interrupted and some rank ended
  // non-zero; kExitSetupFailed; or `stopped_code` when stop()ped otherwise.
  int exit_code(int stopped_code) const;

 private:
  struct Rank;
  struct Stream;
  void read_stream(Stream& stream, bool until_empty);
  void check_children();
  void on_rank_exit(Rank& rank);
  void begin_teardown(int signo);
  void kill_all();
  void signal_groups(int signo);
  std::vector<const Rank*> running() const;
  std::string list_ranks(const std::vector<const Rank*>& ranks) const;

  const LaunchOptions& options_;
  const SupervisorConfig& config_;
  Sink& stdout_;
  Sink& stderr_;
  int master_port_;
  int restart_count_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<Stream*> polled_;  // what append_fds appended, in order
  std::vector<char> buffer_ = std::vector<char>(1 << 16);

  bool setup_failed_ = false;
  bool stopped_ = false;
  int interrupted_by_ = 0;       // signal hprun received, if any
  int first_failure_code_ = -1;  // exit code of the first rank that failed
  std::string failure_;
  Clock::time_point failed_at_;
  bool tearing_down_ = false;
  int teardown_signal_ = SIGTERM;  // what begin_teardown sent: SIGTERM, or the SIGINT forwarded
  bool killed_ = false;
  bool gave_up_ = false;
  bool finished_ = false;
  std::optional<Clock::time_point> kill_at_, give_up_at_;
};

}  // namespace hp::launcher
