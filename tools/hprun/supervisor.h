// Running a job: the ranks' lifetime from spawn to the last exit.
//
// The supervisor starts every rank, copies their output line by line onto
// hprun's stdout/stderr and waits for them. The first rank to fail (non-zero
// exit or death by signal) is reported on stderr, e.g.
//   hprun: rank 1 (pid 1234) exited with status 3
// and the job is torn down: SIGTERM to every rank's process group, SIGKILL
// after a grace period, so that no peer keeps waiting on a dead rank. Ranks
// that die from the teardown are not reported; the first failure is the
// cause, and ranks that exit with an error on their own meanwhile are listed
// after it ("rank 3 (pid 99) also exited with status 1"). SIGINT/SIGTERM sent to hprun are forwarded to every rank's process
// group and start the same teardown; a second one sends SIGKILL at once.
#pragma once

#include "tools/hprun/options.h"

namespace hp::launcher {

struct SupervisorConfig {
  double kill_grace_s = 3.0;     // SIGTERM -> SIGKILL
  double give_up_after_kill_s = 1.0;  // SIGKILL -> stop waiting (a process stuck in D state)
};

// Exit codes of run_job besides a failed rank's own code (its exit status, or
// 128 + signal number).
constexpr int kExitSetupFailed = 1;  // a pipe, fork or port could not be had
constexpr int kExitTimeout = 124;    // --timeout elapsed (as timeout(1))

// Runs the job to the end and returns hprun's exit code: 0 when every rank
// exited 0; the first failed rank's code; 128 + signal number when hprun was
// interrupted and some rank ended non-zero; kExitTimeout; kExitSetupFailed.
// Must be the only thing in the process that waits for children.
int run_job(const LaunchOptions& options, const SupervisorConfig& config = {});

}  // namespace hp::launcher
