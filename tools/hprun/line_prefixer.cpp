#include "tools/hprun/line_prefixer.h"

#include <cstring>
#include <utility>

namespace hp::launcher {

LinePrefixer::LinePrefixer(std::string prefix, std::size_t max_line)
    : prefix_(std::move(prefix)), max_line_(max_line == 0 ? 1 : max_line) {}

void LinePrefixer::emit(const char* line, std::size_t size, std::string* out) const {
  out->append(prefix_);
  out->append(line, size);
  out->push_back('\n');
}

void LinePrefixer::feed(const char* data, std::size_t size, std::string* out) {
  const char* end = data + size;
  while (data < end) {
    const char* newline =
        static_cast<const char*>(std::memchr(data, '\n', static_cast<std::size_t>(end - data)));
    if (newline == nullptr) {
      partial_.append(data, end);
      break;
    }
    if (partial_.empty()) {
      emit(data, static_cast<std::size_t>(newline - data), out);
    } else {
      partial_.append(data, newline);
      emit(partial_.data(), partial_.size(), out);
      partial_.clear();
    }
    data = newline + 1;
  }
  while (partial_.size() >= max_line_) {
    emit(partial_.data(), max_line_, out);
    partial_.erase(0, max_line_);
  }
}

void LinePrefixer::finish(std::string* out) {
  if (partial_.empty()) return;
  emit(partial_.data(), partial_.size(), out);
  partial_.clear();
}

}  // namespace hp::launcher
