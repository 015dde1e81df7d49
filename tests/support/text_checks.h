// Text checks shared by the tests (header-only, no libtorch: the launcher's
// tests use it too).
#pragma once

#include <string>

namespace hp::test {

// Whether `text` contains `part`; tests check messages by their fragments.
inline bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace hp::test
