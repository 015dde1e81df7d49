// The file operations checkpoints are built from: exact reads and writes
// that retry short transfers, and the fsyncs that make a write durable.
// Failures raise SafetensorsError naming the file (safetensors.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hp/checkpoint/read_limits.h"

namespace hp::checkpoint {

// Closes the descriptor on every path out.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  // Hands the descriptor over to the caller, who closes it.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  // Closes now, so that a failing close (a deferred write error) is seen.
  int close();

 private:
  int fd_;
};

// Opens `path` read-only, and only a regular file: a FIFO or device would
// hang or feed a reader without end, so it is opened without blocking
// (O_NONBLOCK) and refused after fstat. A symbolic link is refused too
// (O_NOFOLLOW) unless `follow_links`: a checkpoint's files are never links,
// and one could lead out of the checkpoint; a file the user names directly
// (a consolidated safetensors file in a model cache) may be one. Raises
// naming the file when it cannot open it or it is not a regular file.
int open_for_reading(const std::string& path, bool follow_links = false);

// Reads exactly `bytes` at `offset`; a file that ends first is an error
// ("file ended at byte N").
void read_exact(int fd, void* into, size_t bytes, uint64_t offset, const std::string& path);
void write_all(int fd, const void* from, size_t bytes, const std::string& path);

// fsync of a directory, so that the names created or renamed in it are durable.
void fsync_directory(const std::string& dir);
// fsync of the directory holding `path`.
void fsync_directory_of(const std::string& path);

// Writes `bytes` to `path` through a temporary file in the same directory,
// fsynced and renamed over it (then the directory is fsynced).
void write_file_atomically(const std::string& path, const std::string& bytes);

// The whole file as a string, opened as open_for_reading does (no links).
// A file larger than `max_bytes` (by default the limit on metadata.json,
// read_limits.h) is refused before anything is allocated.
std::string read_whole_file(const std::string& path, uint64_t max_bytes = kMaxMetadataBytes);

// errno's text.
std::string errno_text();

}  // namespace hp::checkpoint
