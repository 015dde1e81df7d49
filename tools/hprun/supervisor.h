// Running a job: one attempt after another until one succeeds, restarts run
// out, or hprun is stopped.
//
// An attempt (attempt.h) starts every local rank and tears them all down
// when one fails: non-zero exit or death by signal; a hung rank shows up as a
// failure because the library's collective timeout makes its peers exit
// non-zero. After a failed attempt, if --max-restarts allows, every rank is
// started again with a fresh rendezvous (a newly picked MASTER_PORT unless
// --master-port was given; TORCHELASTIC_RESTART_COUNT counts the attempts)
// and hprun says why on one line:
//   hprun: restart 1/3: rank 2 (pid 1234) was killed by signal 9 (SIGKILL) at 00:41
// (the time since hprun started). When none are left it says
// "no restarts left: 3 of 3 used" and exits with the failed rank's code.
// Never restarted: an interrupted job (SIGINT/SIGTERM to hprun, forwarded to
// every rank's process group; also when it arrives between attempts), a job
// past --timeout (the wall time across all attempts), a setup failure.
//
// With --nnodes K > 1 the nodes' hprun agents agree on every attempt through
// node 0 (agents.h): every node starts, stops and restarts together, and a
// node that is gone ends the attempt everywhere.
#pragma once

#include "tools/hprun/options.h"

namespace hp::launcher {

struct SupervisorConfig {
  double kill_grace_s = 3.0;          // SIGTERM -> SIGKILL
  double give_up_after_kill_s = 1.0;  // SIGKILL -> stop waiting (a process stuck in D state)
  double heartbeat_s = 1.0;           // --nnodes > 1: agents' heartbeat interval
  double peer_silence_s = 10.0;       // --nnodes > 1: no message this long: the peer is gone
};

// Exit codes of run_job besides a failed rank's own code (its exit status, or
// 128 + signal number).
constexpr int kExitSetupFailed = 1;  // a pipe, fork or port could not be had; a node is gone
constexpr int kExitTimeout = 124;    // --timeout elapsed (as timeout(1))

// Runs the job to the end and returns hprun's exit code: 0 when every rank
// of the last attempt exited 0; the last attempt's first failed rank's code;
// 128 + signal number when hprun was interrupted and some rank ended
// non-zero; kExitTimeout; kExitSetupFailed. Must be the only thing in the
// process that waits for children.
int run_job(const LaunchOptions& options, const SupervisorConfig& config = {});

}  // namespace hp::launcher
