// Small formatting helpers used in error messages and explain() output,
// built on fmt.
#pragma once

#include <cstdint>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <fmt/ostream.h>

namespace hp {

namespace detail {

// Numbers and text go through fmt's own formatting (bools print as
// true/false); anything else (at::ScalarType, c10::Device, IntArrayRef, ...)
// through its operator<<, which is the only formatting libtorch provides.
// The choice depends on the type alone, never on which fmt headers a
// translation unit happened to include.
template <typename T>
void append(fmt::memory_buffer& out, const T& value) {
  if constexpr (std::is_arithmetic_v<T> || std::is_convertible_v<const T&, fmt::string_view>) {
    fmt::format_to(std::back_inserter(out), "{}", value);
  } else {
    fmt::format_to(std::back_inserter(out), "{}", fmt::streamed(value));
  }
}

}  // namespace detail

// cat(a, b, c): the three formatted one after another into one string.
template <typename... Args>
std::string cat(const Args&... args) {
  fmt::memory_buffer out;
  (detail::append(out, args), ...);
  return fmt::to_string(out);
}

// "[1, 2, 3]"; strings are quoted: "['a', 'b']".
std::string to_string(const std::vector<int64_t>& values);
std::string to_string(const std::vector<int>& values);
std::string to_string(const std::vector<std::string>& values);

}  // namespace hp
