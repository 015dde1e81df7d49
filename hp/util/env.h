// Strict reading of the environment variables the library obeys (the list:
// README, "Environment variables"). A value is either exactly what the
// variable allows or an hp::ArgumentError (error.h) that names the
// variable, its value and what was expected; nothing is guessed, clamped or
// silently read as something else ("false" as true, "inf" as a negative
// timeout). An unset or empty variable takes the caller's default ("VAR="
// is how a shell unsets one for a single command).
//
// Thread-safe as far as getenv is: the library reads its variables, it never
// sets them.
#pragma once

#include <initializer_list>
#include <optional>
#include <string>

namespace hp::env {

// The value, or nullopt when unset or empty.
std::optional<std::string> get(const char* name);

// 1/0, true/false, yes/no, on/off (any case).
bool parse_bool(const std::string& name, const std::string& value);
// A decimal integer (an optional '-', then digits only) in [min, max].
long parse_int(const std::string& name, const std::string& value, long min, long max);
// A finite number of seconds in [min_s, max_s] (decimal or exponent form).
double parse_seconds(const std::string& name, const std::string& value, double min_s,
                     double max_s);

bool get_bool(const char* name, bool fallback);
std::optional<long> get_int(const char* name, long min, long max);
std::optional<double> get_seconds(const char* name, double min_s, double max_s);
// One of `choices`, exactly; nullopt when unset.
std::optional<std::string> get_choice(const char* name, std::initializer_list<const char*> choices);

}  // namespace hp::env
