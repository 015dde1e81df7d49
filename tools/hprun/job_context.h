// What every attempt of one job shares: the options, hprun's output streams,
// the signal pipe and the job's clock (--timeout spans all attempts).
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include "tools/hprun/attempt.h"
#include "tools/hprun/options.h"
#include "tools/hprun/signal_pipe.h"
#include "tools/hprun/supervisor.h"

namespace hp::launcher {

struct JobContext {
  const LaunchOptions& options;
  const SupervisorConfig& config;
  SignalPipe& signals;
  Sink& out;
  Sink& err;
  Clock::time_point started;
  std::optional<Clock::time_point> deadline;  // --timeout, if given

  void say(const std::string& line) { launcher::say(err, line); }
  // "00:41": how long hprun has been running at `t`.
  std::string at(Clock::time_point t) const {
    return clock_text(std::chrono::duration<double>(t - started).count());
  }
  std::string timeout_message() const {
    return "the job ran longer than --timeout " + seconds_text(options.timeout_s);
  }
};

}  // namespace hp::launcher
