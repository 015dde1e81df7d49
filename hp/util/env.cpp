#include "hp/util/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "hp/util/error.h"

namespace hp::env {

std::optional<std::string> get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

bool parse_bool(const std::string& name, const std::string& value) {
  std::string lower = value;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const char* yes : {"1", "true", "yes", "on"}) {
    if (lower == yes) return true;
  }
  for (const char* no : {"0", "false", "no", "off"}) {
    if (lower == no) return false;
  }
  throw ArgumentError(cat(name, " must be 1/0, true/false, yes/no or on/off, got '", value, "'"));
}

long parse_int(const std::string& name, const std::string& value, long min, long max) {
  // strtol alone would take " 7", "+7" and "7abc"'s prefix.
  const std::size_t digits_at = !value.empty() && value[0] == '-' ? 1 : 0;
  bool ok = value.size() > digits_at &&
            std::all_of(value.begin() + static_cast<long>(digits_at), value.end(),
                        [](unsigned char c) { return std::isdigit(c) != 0; });
  long parsed = 0;
  if (ok) {
    errno = 0;
    parsed = std::strtol(value.c_str(), nullptr, 10);
    ok = errno == 0 && parsed >= min && parsed <= max;
  }
  HP_CHECK_ARG(ok, name, " must be an integer in [", min, ", ", max, "], got '", value, "'");
  return parsed;
}

double parse_seconds(const std::string& name, const std::string& value, double min_s,
                     double max_s) {
  char* end = nullptr;
  errno = 0;
  const double parsed = std::strtod(value.c_str(), &end);
  // No leading space (strtod skips it), no "inf"/"nan" (not finite), no
  // hex floats; ranges both ends inclusive.
  const bool ok = !value.empty() && !std::isspace(static_cast<unsigned char>(value[0])) &&
                  end != nullptr && *end == '\0' && errno == 0 && std::isfinite(parsed) &&
                  value.find_first_of("xX") == std::string::npos && parsed >= min_s &&
                  parsed <= max_s;
  HP_CHECK_ARG(ok, name, " must be a number of seconds in [", min_s, ", ", max_s, "], got '",
               value, "'");
  return parsed;
}

bool get_bool(const char* name, bool fallback) {
  auto value = get(name);
  return value ? parse_bool(name, *value) : fallback;
}

std::optional<long> get_int(const char* name, long min, long max) {
  auto value = get(name);
  if (!value) return std::nullopt;
  return parse_int(name, *value, min, max);
}

std::optional<double> get_seconds(const char* name, double min_s, double max_s) {
  auto value = get(name);
  if (!value) return std::nullopt;
  return parse_seconds(name, *value, min_s, max_s);
}

std::optional<std::string> get_choice(const char* name,
                                      std::initializer_list<const char*> choices) {
  auto value = get(name);
  if (!value) return std::nullopt;
  std::string expected;
  for (const char* choice : choices) {
    if (*value == choice) return value;
    expected += (expected.empty() ? "'" : " or '") + std::string(choice) + "'";
  }
  throw ArgumentError(cat(name, " must be ", expected, ", got '", *value, "'"));
}

}  // namespace hp::env
