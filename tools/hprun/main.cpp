// hprun: starts N local ranks of a program and supervises them (D4).
// See options.h for the command line and supervisor.h for what happens when
// a rank fails or hprun is interrupted.

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "tools/hprun/options.h"
#include "tools/hprun/supervisor.h"

namespace {

// With stdout closed at startup, the first pipe hprun creates would become
// fd 1 and rank output would be copied into a rank's own pipe.
void ensure_standard_fds_open() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) == -1) ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace hp::launcher;
  ensure_standard_fds_open();
  CommandLine command_line;
  try {
    command_line = parse_command_line(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const UsageError& e) {
    std::fprintf(stderr, "hprun: %s\n", e.what());
    return kExitUsage;
  }
  if (command_line.help_requested) {
    std::fputs(command_line.help_text.c_str(), stdout);
    return 0;
  }
  try {
    return run_job(command_line.options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hprun: %s\n", e.what());
    return kExitSetupFailed;
  }
}
