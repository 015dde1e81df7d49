// Parsing a tool's command line with CLI11 one way for hprun, hp-train and
// hp-bench: -h/--help hands back the help text, and every error becomes one
// sentence that starts with what was wrong.
//
//   a value fails its check   "--batch must be ..." (CLI11 writes "--batch: must be ...")
//   an unknown flag           "unknown flag '--stpes' (did you mean --steps?); <hint>"
//   a stray argument          "unexpected argument 'x'; <hint>"
//   anything else             CLI11's own text, then "; <hint>"
//
// <hint> is the tool's pointer to its usage ("see hp-train --help"). The
// caller turns a CommandLineError into its own error type and exit status.
// No libtorch (hprun links it).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace hp::tools {

class CommandLineError : public std::invalid_argument {
 public:
  explicit CommandLineError(const std::string& what) : std::invalid_argument(what) {}
};

struct ParsedCommandLine {
  bool help_requested = false;  // -h/--help: print help_text and exit 0
  std::string help_text;
};

// `args` excludes argv[0]. Throws CommandLineError as above.
ParsedCommandLine parse_command_line(CLI::App& app, const std::vector<std::string>& args,
                                     const std::string& hint);

}  // namespace hp::tools
