// Small formatting helpers used in error messages and explain() output.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace hp {

// cat(a, b, c) == the three streamed into one string.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// "[1, 2, 3]"
std::string to_string(const std::vector<int64_t>& values);
std::string to_string(const std::vector<int>& values);
std::string to_string(const std::vector<std::string>& values);

}  // namespace hp
