#include "hp/distributed/comm_stats.h"

#include <fmt/format.h>

namespace hp::dist {

int64_t CommStats::total() const {
  int64_t sum = 0;
  for (int64_t n : calls) sum += n;
  return sum;
}

std::string CommStats::describe_calls() const {
  std::string text;
  for (OpType op : kOpTypes) {
    text += fmt::format("{}{} {}", text.empty() ? "" : ", ", op_name(op), (*this)[op]);
  }
  return text;
}

CommStats operator-(const CommStats& later, const CommStats& earlier) {
  CommStats d;
  for (size_t i = 0; i < d.calls.size(); ++i) d.calls[i] = later.calls[i] - earlier.calls[i];
  d.comm_seconds = later.comm_seconds - earlier.comm_seconds;
  d.wait_seconds = later.wait_seconds - earlier.wait_seconds;
  return d;
}

}  // namespace hp::dist
