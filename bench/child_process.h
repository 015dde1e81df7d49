// Runs a program to completion with its stdout and stderr merged into one
// pipe, line by line. hp-bench starts its rows this way, one after another.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace hp::bench {

struct ChildResult {
  int exit_status = 0;  // the program's exit status, or 128 + signal
  std::string how;      // "exit status 3", "killed by signal 9", "exec failed: ..."
  std::vector<std::string> lines;
};

// argv[0] is a path (no PATH search). `on_line` sees each output line as it
// arrives (without the newline). Throws std::runtime_error when the pipe or
// the process cannot be created.
ChildResult run_child(const std::vector<std::string>& argv,
                      const std::function<void(const std::string&)>& on_line);

// "a b 'c d'" for logs.
std::string shell_words(const std::vector<std::string>& argv);

}  // namespace hp::bench
