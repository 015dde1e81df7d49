#include "hp/util/format.h"

#include <fmt/ranges.h>

namespace hp {

std::string to_string(const std::vector<int64_t>& values) {
  return fmt::format("[{}]", fmt::join(values, ", "));
}

std::string to_string(const std::vector<int>& values) {
  return fmt::format("[{}]", fmt::join(values, ", "));
}

std::string to_string(const std::vector<std::string>& values) {
  if (values.empty()) return "[]";
  return fmt::format("['{}']", fmt::join(values, "', '"));
}

}  // namespace hp
