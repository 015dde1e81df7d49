#include "hp/checkpoint/read_limits.h"

#include <nlohmann/json.hpp>

namespace hp::checkpoint {

std::optional<size_t> json_too_deep(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is, does not end the string
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '[':
      case '{':
        if (++depth > max_depth) return i;
        break;
      case ']':
      case '}':
        // Unbalanced closers are the parser's to report; depth only grows
        // from here on the openers that follow.
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return std::nullopt;
}

std::string json_excerpt(const nlohmann::ordered_json& value, size_t max_chars) {
  // Values come from parsed text (valid UTF-8); replace keeps a cut
  // multi-byte character or anything else from throwing here.
  std::string text = value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  if (text.size() > max_chars) {
    text.resize(max_chars);
    text += "...";
  }
  return text;
}

std::optional<uint64_t> checked_tensor_bytes(const std::vector<int64_t>& shape,
                                             uint64_t element_size) {
  uint64_t extent = element_size;  // the product with 0 dims counted as 1
  bool empty = false;
  for (int64_t d : shape) {
    if (d < 0) return std::nullopt;
    if (d == 0) {
      empty = true;
      continue;
    }
    if (__builtin_mul_overflow(extent, static_cast<uint64_t>(d), &extent)) return std::nullopt;
  }
  if (extent > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
  return empty ? 0 : extent;
}

}  // namespace hp::checkpoint
