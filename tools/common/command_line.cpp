#include "tools/common/command_line.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>

namespace hp::tools {
namespace {

// Levenshtein distance: how many one-character edits turn a into b.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitution = diagonal + (a[i - 1] == b[j - 1] ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitution});
    }
  }
  return row[b.size()];
}

// CLI11 reports every argument it could not place ("The following arguments
// were not expected: 10 --step"); name the first unknown flag instead and
// the known one it most likely meant.
std::string unknown_argument_message(const CLI::App& app) {
  const std::vector<std::string> extras = app.remaining();
  const auto flag = std::find_if(extras.begin(), extras.end(), [](const std::string& a) {
    return a.size() > 1 && a[0] == '-';
  });
  if (flag == extras.end()) return fmt::format("unexpected argument '{}'", extras.at(0));
  const std::string name = flag->substr(0, flag->find('='));
  std::string best;
  size_t best_distance = std::max<size_t>(2, name.size() / 3) + 1;  // a typo, not another word
  for (const CLI::Option* option : app.get_options()) {
    for (const std::string& long_name : option->get_lnames()) {
      const std::string candidate = "--" + long_name;
      const size_t distance = edit_distance(name, candidate);
      if (distance < best_distance) {
        best = candidate;
        best_distance = distance;
      }
    }
  }
  return best.empty() ? fmt::format("unknown flag '{}'", name)
                      : fmt::format("unknown flag '{}' (did you mean {}?)", name, best);
}

}  // namespace

ParsedCommandLine parse_command_line(CLI::App& app, const std::vector<std::string>& args,
                                     const std::string& hint) {
  ParsedCommandLine result;
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11's convention
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    result.help_requested = true;
    result.help_text = app.help();
  } catch (const CLI::ExtrasError&) {
    throw CommandLineError(fmt::format("{}; {}", unknown_argument_message(app), hint));
  } catch (const CLI::ValidationError& e) {
    // CLI11 writes "--batch: must be ..."; the flag starts our sentence.
    std::string message = e.what();
    const size_t colon = message.find(": ");
    if (colon != std::string::npos) message.replace(colon, 2, " ");
    throw CommandLineError(message);
  } catch (const CLI::ParseError& e) {
    throw CommandLineError(fmt::format("{}; {}", e.what(), hint));
  }
  return result;
}

}  // namespace hp::tools
