#include "hp/checkpoint/root_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <filesystem>
#include <map>
#include <random>
#include <system_error>

#include <fmt/format.h>

#include "hp/checkpoint/errors.h"
#include "hp/checkpoint/file_io.h"
#include "hp/util/format.h"

namespace hp::checkpoint {
namespace fs = std::filesystem;

namespace {

// The holder text a reader shows is another process's file: at most this
// much of it, printable ASCII only.
constexpr size_t kMaxHolderBytes = 512;

struct Held {
  int fd = -1;
  dev_t dev = 0;
  ino_t ino = 0;
};

// Roots whose lock this process holds, by lock file path; the descriptors
// stay open (the lock lives as long as they do) until the process exits.
std::map<std::string, Held>& held_locks() {
  static std::map<std::string, Held> held;
  return held;
}

std::mutex& held_mutex() {
  static std::mutex m;
  return m;
}

[[noreturn]] void fail_lock(const std::string& path, const std::string& what) {
  throw CheckpointError(cat("checkpoint root lock ", path, ": ", what));
}

std::string holder_of(int fd) {
  char buffer[kMaxHolderBytes];
  const ssize_t n = ::pread(fd, buffer, sizeof buffer, 0);
  if (n <= 0) return "an unnamed process (the lock file is empty)";
  std::string text;
  for (ssize_t i = 0; i < n; ++i) {
    const char c = buffer[i];
    if (c == '\n') break;
    text += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return text;
}

}  // namespace

const std::string& lock_holder_text() {
  static const std::string text = [] {
    char host[256] = {0};
    if (::gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "unknown");
    std::random_device entropy;
    const uint64_t run = (uint64_t{entropy()} << 32) ^ entropy();
    const std::time_t now = std::time(nullptr);
    std::tm utc{};
    ::gmtime_r(&now, &utc);
    char since[32];
    std::strftime(since, sizeof since, "%Y-%m-%dT%H:%M:%SZ", &utc);
    return fmt::format("host {} pid {} run {:016x} since {}", host, ::getpid(), run, since);
  }();
  return text;
}

std::mutex& root_directory_mutex() {
  static std::mutex m;
  return m;
}

bool lock_root(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw CheckpointError(cat("checkpoint directory ", root, ": cannot create it: ",
                                    ec.message()));
  const std::string path = (fs::path(root) / kRootLockFile).string();
  std::lock_guard<std::mutex> guard(held_mutex());
  auto& held = held_locks();
  if (auto it = held.find(path); it != held.end()) {
    // Still the file we locked? A root removed and made again (or a lock
    // file replaced) holds a new, unlocked file.
    struct stat now {};
    if (::lstat(path.c_str(), &now) == 0 && now.st_dev == it->second.dev &&
        now.st_ino == it->second.ino) {
      return false;
    }
    ::close(it->second.fd);
    held.erase(it);
  }
  // No link (it could make this job lock, and write into, a file elsewhere)
  // and no FIFO (an open for writing would block): refused by name.
  Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0644));
  if (fd.get() < 0) {
    if (errno == ELOOP) fail_lock(path, "is a symbolic link; expected a regular file");
    fail_lock(path, cat("cannot open it: ", errno_text()));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail_lock(path, cat("cannot stat it: ", errno_text()));
  if (!S_ISREG(st.st_mode)) fail_lock(path, "is not a regular file; expected the lock file");
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      throw CheckpointError(cat(
          "checkpoint root ", root, " is in use by another job: ", path, " is locked by ",
          holder_of(fd.get()), " (this process: ", lock_holder_text(),
          "); two jobs saving into one root would overwrite each other's checkpoints: give "
          "each job its own root (hp-train: --save-dir), or stop the other job"));
    }
    fail_lock(path, cat("cannot lock it (flock): ", errno_text(),
                        "; saves need a file system with locks, so that two jobs cannot "
                        "share the root unnoticed"));
  }
  const std::string text = lock_holder_text() + "\n";
  if (::ftruncate(fd.get(), 0) != 0) fail_lock(path, cat("cannot truncate it: ", errno_text()));
  write_all(fd.get(), text.data(), text.size(), path);
  held[path] = Held{fd.release(), st.st_dev, st.st_ino};
  return true;
}

}  // namespace hp::checkpoint
