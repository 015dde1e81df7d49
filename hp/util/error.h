// Exception types of the library.
//
// Every bad argument raises ArgumentError (a std::invalid_argument) whose
// message names the argument, the value it got and what was expected, and it
// is raised before any collective is issued, so one rank's bad input never
// leaves its peers waiting. Failures of collectives themselves (timeouts, a
// dead peer, a backend error) raise CollectiveError with the op, the group's
// ranks, the tensor sizes and the group's sequence number; what such a
// failure leaves unusable raises UnusableError from then on.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

#include "hp/util/format.h"

namespace hp {

class ArgumentError : public std::invalid_argument {
 public:
  explicit ArgumentError(const std::string& what) : std::invalid_argument(what) {}
};

class CollectiveError : public std::runtime_error {
 public:
  explicit CollectiveError(const std::string& what) : std::runtime_error(what) {}
};

// An object that a failure left unusable (e.g. fully_shard units after a
// collective timed out mid-step): the message says what failed and what to
// rebuild. Raised at once, before any collective, by every later use.
class UnusableError : public std::runtime_error {
 public:
  explicit UnusableError(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void throw_argument_error(const std::string& message);

// e.what() for the messages we wrap: a c10::Error's what() ends in a C++
// backtrace, which would bury the cause, so that part is dropped.
std::string exception_message(const std::exception& e);

}  // namespace hp

// HP_CHECK_ARG(cond, parts...) throws hp::ArgumentError with the parts
// concatenated (operator<< semantics) when cond is false.
#define HP_CHECK_ARG(cond, ...)                              \
  do {                                                       \
    if (!(cond)) {                                           \
      ::hp::throw_argument_error(::hp::cat(__VA_ARGS__));    \
    }                                                        \
  } while (0)
