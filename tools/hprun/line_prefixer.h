// Splitting a rank's output stream into whole, prefixed lines.
//
// Every rank writes into its own pipe; hprun copies the pipes onto one stdout
// and one stderr. Copying whole lines only, each in one write, is what keeps
// two ranks from ever mixing inside one line. Bytes after the last newline
// wait in the buffer for the rest of their line.
#pragma once

#include <cstddef>
#include <string>

namespace hp::launcher {

class LinePrefixer {
 public:
  // A line longer than max_line is cut and emitted in pieces, so a rank that
  // never writes a newline (a progress bar drawn with '\r') cannot make hprun
  // buffer without bound.
  explicit LinePrefixer(std::string prefix, std::size_t max_line = std::size_t{1} << 20);

  // Appends to *out every line that `data` completes: prefix, line, '\n'.
  void feed(const char* data, std::size_t size, std::string* out);

  // Appends the unterminated tail, if any, as a line with '\n' added. Called
  // when the stream ends, so a last line without newline is not lost.
  void finish(std::string* out);

  bool has_partial_line() const { return !partial_.empty(); }

 private:
  void emit(const char* line, std::size_t size, std::string* out) const;

  std::string prefix_;
  std::size_t max_line_;
  std::string partial_;
};

}  // namespace hp::launcher
