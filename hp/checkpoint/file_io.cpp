#include "hp/checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "hp/checkpoint/safetensors.h"
#include "hp/util/format.h"

namespace hp::checkpoint {
namespace {

[[noreturn]] void fail_file(const std::string& path, const std::string& what) {
  throw SafetensorsError(cat("file ", path, ": ", what));
}

const char* kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
  if (S_ISSOCK(mode)) return "a socket";
  return "something else";
}

}  // namespace

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

int Fd::close() {
  int rc = ::close(fd_);
  fd_ = -1;
  return rc;
}

std::string errno_text() { return std::strerror(errno); }

int open_for_reading(const std::string& path, bool follow_links) {
  // O_NONBLOCK only matters for what is refused below: reads of a regular
  // file never block on it.
  const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow_links ? 0 : O_NOFOLLOW);
  Fd fd(::open(path.c_str(), flags));
  if (fd.get() < 0) {
    if (errno == ELOOP && !follow_links) {
      fail_file(path, "is a symbolic link; a checkpoint's files are read only as regular files "
                      "inside it");
    }
    fail_file(path, cat("cannot open: ", errno_text()));
  }
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail_file(path, cat("cannot stat: ", errno_text()));
  if (!S_ISREG(st.st_mode)) {
    fail_file(path, cat("is ", kind_of(st.st_mode), ", not a regular file; only regular files are "
                        "read"));
  }
  return fd.release();
}

void read_exact(int fd, void* into, size_t bytes, uint64_t offset, const std::string& path) {
  auto* p = static_cast<char*>(into);
  while (bytes > 0) {
    ssize_t got = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail_file(path, cat("read failed at byte ", offset, ": ", errno_text()));
    if (got == 0) fail_file(path, cat("file ended at byte ", offset, " while reading"));
    p += got;
    bytes -= static_cast<size_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

void write_all(int fd, const void* from, size_t bytes, const std::string& path) {
  const auto* p = static_cast<const char*>(from);
  while (bytes > 0) {
    ssize_t put = ::write(fd, p, bytes);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) fail_file(path, cat("write failed: ", errno_text()));
    p += put;
    bytes -= static_cast<size_t>(put);
  }
}

void fsync_directory(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0 || ::fsync(fd.get()) != 0) {
    fail_file(dir, cat("cannot fsync the directory: ", errno_text()));
  }
}

void fsync_directory_of(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  fsync_directory(dir.empty() ? "." : dir);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  static std::atomic<uint64_t> counter{0};
  const std::string temp = cat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  try {
    Fd fd(::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666));
    if (fd.get() < 0) fail_file(path, cat("cannot create '", temp, "': ", errno_text()));
    write_all(fd.get(), bytes.data(), bytes.size(), temp);
    if (::fsync(fd.get()) != 0) fail_file(path, cat("cannot fsync '", temp, "': ", errno_text()));
    if (fd.close() != 0) fail_file(path, cat("cannot close '", temp, "': ", errno_text()));
    if (::rename(temp.c_str(), path.c_str()) != 0) {
      fail_file(path, cat("cannot rename '", temp, "' over it: ", errno_text()));
    }
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  fsync_directory_of(path);
}

std::string read_whole_file(const std::string& path, uint64_t max_bytes) {
  Fd fd(open_for_reading(path));
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) fail_file(path, cat("cannot stat: ", errno_text()));
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size > max_bytes) {
    fail_file(path, cat("has ", size, " bytes, more than the ", max_bytes,
                        " this reader accepts (docs/features.md, C8)"));
  }
  std::string bytes(static_cast<size_t>(size), '\0');
  read_exact(fd.get(), bytes.data(), bytes.size(), 0, path);
  return bytes;
}

}  // namespace hp::checkpoint
