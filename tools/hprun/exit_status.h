// Wording and exit codes for how a rank ended, shell conventions throughout.
#pragma once

#include <csignal>
#include <string>

namespace hp::launcher {

// "SIGKILL" for 9; "signal 64" for numbers without a common name.
std::string signal_name(int signo);

// For a waitpid() status: "exited with status 3" or
// "was killed by signal 9 (SIGKILL)".
std::string describe_wait_status(int status);

// The exit code a shell would report for a waitpid() status: the exit status,
// or 128 + the signal number.
int exit_code_of(int status);

// The waitpid() status equivalent to what waitid() reported in `info`, so
// that a child can be inspected with WNOWAIT (leaving it a zombie, whose pid
// keeps its process group id from being reused) and still be described with
// the W* macros.
int wait_status_from(const siginfo_t& info);

}  // namespace hp::launcher
