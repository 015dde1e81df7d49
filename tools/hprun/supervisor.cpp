#include "tools/hprun/supervisor.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <optional>
#include <string>
#include <vector>

#include "tools/hprun/agents.h"
#include "tools/hprun/attempt.h"
#include "tools/hprun/free_port.h"
#include "tools/hprun/job_context.h"
#include "tools/hprun/signal_pipe.h"

namespace hp::launcher {
namespace {

// One node: the restart decision is this hprun's alone.
class SingleNodeJob {
 public:
  explicit SingleNodeJob(JobContext& job) : job_(job) {}
  int run();

 private:
  // Runs one attempt to its end; returns its exit code.
  int run_attempt(Attempt& attempt);
  void poll_once(Attempt* attempt, int timeout_ms);

  JobContext& job_;
  bool interrupted_ = false;
  bool timed_out_ = false;
};

int SingleNodeJob::run() {
  int previous_port = 0;
  for (int restart = 0;; ++restart) {
    int port = job_.options.master_port;
    try {
      // A fresh rendezvous on a fresh port: the last attempt's store may
      // still linger on its port.
      for (int tries = 0; port == 0 || (port == previous_port && tries < 8); ++tries) {
        port = pick_free_port();
      }
    } catch (const std::exception& e) {
      job_.say(e.what());
      return kExitSetupFailed;
    }
    previous_port = job_.options.master_port == 0 ? port : 0;
    Attempt attempt(job_.options, job_.config, job_.out, job_.err, port, restart);
    int code = run_attempt(attempt);
    // A signal that came while the attempt was being reaped still counts.
    poll_once(nullptr, 0);
    if (!attempt.failed() || interrupted_ || timed_out_) return code;
    const int max = job_.options.max_restarts;
    if (restart == max) {
      if (max > 0) {
        job_.say("no restarts left: " + std::to_string(max) + " of " + std::to_string(max) +
                 " used");
      }
      return code;
    }
    job_.say("restart " + std::to_string(restart + 1) + "/" + std::to_string(max) + ": " +
             attempt.failure() + " at " + job_.at(attempt.failed_at()));
  }
}

int SingleNodeJob::run_attempt(Attempt& attempt) {
  attempt.start();
  while (!attempt.done()) {
    std::optional<Clock::time_point> next = attempt.next_deadline();
    if (!timed_out_ && job_.deadline && (!next || *job_.deadline < *next)) next = job_.deadline;
    poll_once(&attempt, poll_wait_ms(next));
    Clock::time_point now = Clock::now();
    attempt.check(now);
    if (!timed_out_ && job_.deadline && now >= *job_.deadline && !attempt.done()) {
      timed_out_ = true;
      // Said also when a failure's teardown is under way: it is why no
      // restart follows.
      job_.say(job_.timeout_message() + "; terminating the ranks");
      attempt.stop("");
    }
  }
  attempt.finish();
  // A failure that came first keeps its code; --timeout comes before an
  // interruption, as in timeout(1).
  if (timed_out_ && !attempt.failed() && !attempt.setup_failed()) return kExitTimeout;
  return attempt.exit_code(kExitTimeout);
}

// Polls the signal pipe and the attempt's pipes (if any) once.
void SingleNodeJob::poll_once(Attempt* attempt, int wait_ms) {
  std::vector<pollfd> fds{{job_.signals.fd(), POLLIN, 0}};
  if (attempt) attempt->append_fds(&fds);
  int ready = ::poll(fds.data(), fds.size(), wait_ms);
  if (ready <= 0) {
    if (attempt) attempt->on_poll(fds.data() + 1);
    return;
  }
  if (fds[0].revents != 0) {
    for (int signo : job_.signals.drain()) {
      if (signo != SIGINT && signo != SIGTERM) continue;
      if (attempt) {
        attempt->on_signal(signo);
      } else if (!interrupted_) {
        job_.say("received " + std::string(signo == SIGINT ? "SIGINT" : "SIGTERM") +
                 "; not restarting");
      }
      interrupted_ = true;
    }
  }
  if (attempt) attempt->on_poll(fds.data() + 1);
}

}  // namespace

int run_job(const LaunchOptions& options, const SupervisorConfig& config) {
  // A vanished reader of our stdout must not kill hprun (and with it, via
  // PDEATHSIG, every rank); Sink drops the output instead.
  struct sigaction ignore {}, previous_sigpipe {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &previous_sigpipe);
  int code = 0;
  {
    // Installed before the first fork, so a signal can never find a rank
    // started but not yet known to the loop.
    SignalPipe signals({SIGINT, SIGTERM, SIGCHLD});
    Sink out(STDOUT_FILENO), err(STDERR_FILENO);
    JobContext job{options, config, signals, out, err, Clock::now(), std::nullopt};
    if (options.timeout_s > 0) {
      job.deadline = after(job.started, options.timeout_s);
    }
    code = options.nnodes > 1 ? run_agent(job) : SingleNodeJob(job).run();
  }
  ::sigaction(SIGPIPE, &previous_sigpipe, nullptr);
  return code;
}

}  // namespace hp::launcher
