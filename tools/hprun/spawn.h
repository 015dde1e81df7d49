// Starting one rank as a child process.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace hp::launcher {

struct RankProcess {
  pid_t pid = -1;      // also the id of the rank's process group
  int stdout_fd = -1;  // read ends of the rank's stdout / stderr pipes,
  int stderr_fd = -1;  // non-blocking and close-on-exec
};

// Starts `argv` (argv[0] looked up in PATH, as execvp does) with environment
// `env` ("NAME=value" entries). The child
//  - leads a new process group, so that signalling -pid reaches the rank's
//    own children too, and a Ctrl-C on the terminal reaches only hprun,
//    which decides what the ranks get;
//  - receives SIGKILL when hprun dies (PR_SET_PDEATHSIG), so a killed hprun
//    leaves no ranks behind; only the rank's direct process is covered;
//  - reads stdin from /dev/null: it is in a background process group, where
//    reading the terminal would stop it, and N ranks cannot share one stdin;
//  - starts with default signal dispositions and an empty signal mask.
// If exec fails the child writes "hprun: rank R: cannot execute 'prog': why"
// to hprun's stderr and exits 127 (not found) or 126 (not executable), which
// the supervisor then treats like any failing rank.
// Throws std::runtime_error when the pipes or the fork cannot be created.
RankProcess spawn_rank(int rank, const std::vector<std::string>& argv,
                       const std::vector<std::string>& env);

}  // namespace hp::launcher
