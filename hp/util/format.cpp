#include "hp/util/format.h"

namespace hp {
namespace {

template <typename T>
std::string join(const std::vector<T>& values, bool quote) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) out << ", ";
    if (quote) out << "'";
    out << values[i];
    if (quote) out << "'";
  }
  out << "]";
  return out.str();
}

}  // namespace

std::string to_string(const std::vector<int64_t>& values) { return join(values, false); }
std::string to_string(const std::vector<int>& values) { return join(values, false); }
std::string to_string(const std::vector<std::string>& values) { return join(values, true); }

}  // namespace hp
