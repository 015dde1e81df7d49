#include "hp/checkpoint/directory.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <system_error>

#include <fmt/format.h>

#include "hp/checkpoint/checkpoint.h"
#include "hp/checkpoint/file_io.h"
#include "hp/util/format.h"

namespace hp::checkpoint {
namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail_directory(const std::string& path, const std::string& what) {
  throw CheckpointError(cat("checkpoint directory ", path, ": ", what));
}

void rename_or_fail(const fs::path& from, const fs::path& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0) {
    fail_directory(to.string(), cat("cannot rename '", from.string(), "' to it: ", errno_text()));
  }
}

// Swaps the directories `a` and `b` in one step (Linux renameat2 with
// RENAME_EXCHANGE). False where the kernel or the file system has no
// exchange (the caller then replaces in two renames); any other failure
// raises naming `b`.
bool exchange_dirs(const fs::path& a, const fs::path& b) {
#if defined(__linux__) && defined(SYS_renameat2)
  constexpr unsigned kRenameExchange = 1u << 1;  // RENAME_EXCHANGE, linux/fs.h
  if (::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), kRenameExchange) == 0) {
    return true;
  }
  if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP || errno == EOPNOTSUPP) return false;
  fail_directory(b.string(), cat("cannot exchange it with '", a.string(), "': ", errno_text()));
#else
  (void)a;
  (void)b;
  return false;
#endif
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step-{:08d}", step); }

std::string rank_file_name(int rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

std::string temp_dir(const std::string& root, int64_t step) {
  return (fs::path(root) / (".tmp-" + checkpoint_dir_name(step))).string();
}

void prepare_temp_dir(const std::string& root, int64_t step) {
  const fs::path temp = temp_dir(root, step);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) fail_directory(root, cat("cannot create it: ", ec.message()));
  fs::remove_all(temp, ec);
  if (ec) {
    fail_directory(temp.string(),
                   cat("cannot remove a leftover of an earlier save: ", ec.message()));
  }
  fs::create_directory(temp, ec);
  if (ec) fail_directory(temp.string(), cat("cannot create it: ", ec.message()));
}

std::string old_dir(const std::string& root, int64_t step) {
  return (fs::path(root) / (".old-" + checkpoint_dir_name(step))).string();
}

std::string commit_dir(const std::string& root, const std::string& temp, int64_t step) {
  const fs::path final_path = fs::path(root) / checkpoint_dir_name(step);
  const fs::path old = old_dir(root, step);
  std::error_code ec;
  const bool replacing = fs::exists(fs::symlink_status(final_path, ec));
  if (!replacing) {
    rename_or_fail(temp, final_path);
    fsync_directory(root);
    return final_path.string();
  }
  if (exchange_dirs(temp, final_path)) {
    // `temp` now holds the replaced checkpoint.
    fsync_directory(root);
    fs::remove_all(temp, ec);
    return final_path.string();
  }
  fs::remove_all(old, ec);
  rename_or_fail(final_path, old);
  if (std::rename(temp.c_str(), final_path.c_str()) != 0) {
    const std::string why = errno_text();
    std::rename(old.c_str(), final_path.c_str());  // the replaced one is step-N again
    fail_directory(final_path.string(), cat("cannot rename '", temp, "' to it: ", why));
  }
  fsync_directory(root);
  fs::remove_all(old, ec);
  return final_path.string();
}

namespace {

// A checkpoint-like entry of a root: a real directory named step-N,
// .old-step-N or .tmp-step-N.
struct Entry {
  enum Kind { kStep, kOld, kTemp } kind;
  int64_t step;
  fs::path path;
};

std::vector<Entry> entries_of(const std::string& root) {
  static const std::regex kName("(step|\\.old-step|\\.tmp-step)-([0-9]+)");
  std::vector<Entry> entries;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::smatch match;
    if (!std::regex_match(name, match, kName)) continue;
    // Only real directories: a link is someone else's.
    std::error_code type_ec;
    if (!fs::is_directory(fs::symlink_status(it->path(), type_ec))) continue;
    const std::string digits = match[2].str();
    int64_t step = 0;
    const auto [end_of_number, parse_ec] =
        std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (parse_ec != std::errc() || end_of_number != digits.data() + digits.size()) {
      fail_directory(it->path().string(),
                     cat("step ", digits, " is beyond the largest step a save writes, ",
                         INT64_MAX));
    }
    const std::string kind = match[1].str();
    entries.push_back({kind == "step" ? Entry::kStep
                                      : kind == ".old-step" ? Entry::kOld : Entry::kTemp,
                       step, it->path()});
  }
  return entries;
}

bool has_metadata(const fs::path& dir) {
  // The metadata itself is checked when it is read (a link or a FIFO there
  // is refused with its name).
  std::error_code ec;
  return fs::exists(fs::symlink_status(dir / kMetadataFile, ec));
}

}  // namespace

std::vector<std::string> recover_leftovers(const std::string& root, bool remove_temps) {
  std::vector<std::string> done;
  const std::vector<Entry> entries = entries_of(root);
  std::set<int64_t> steps;
  for (const Entry& e : entries) {
    if (e.kind == Entry::kStep) steps.insert(e.step);
  }
  std::error_code ec;
  for (const Entry& e : entries) {
    if (e.kind == Entry::kOld) {
      const fs::path final_path = fs::path(root) / checkpoint_dir_name(e.step);
      if (steps.count(e.step) == 0 && has_metadata(e.path)) {
        rename_or_fail(e.path, final_path);
        fsync_directory(root);
        done.push_back(cat("recovered ", final_path.string(), " from ", e.path.string(),
                           " (a replace of that step stopped between its two renames)"));
      } else {
        fs::remove_all(e.path, ec);
        if (ec) fail_directory(e.path.string(), cat("cannot remove it: ", ec.message()));
        done.push_back(cat("removed ", e.path.string(), " (left by a replace of ",
                           final_path.string(), ")"));
      }
    } else if (e.kind == Entry::kTemp && remove_temps) {
      fs::remove_all(e.path, ec);
      if (ec) fail_directory(e.path.string(), cat("cannot remove it: ", ec.message()));
      done.push_back(cat("removed ", e.path.string(), " (left by a save that did not finish)"));
    }
  }
  return done;
}

std::vector<CheckpointDir> complete_checkpoints(const std::string& root) {
  const std::vector<Entry> entries = entries_of(root);
  std::map<int64_t, std::string> found;  // step -> directory
  for (const Entry& e : entries) {
    if (e.kind == Entry::kStep && has_metadata(e.path)) found[e.step] = e.path.string();
  }
  for (const Entry& e : entries) {
    // A step directory without metadata is no checkpoint, nor someone's
    // crashed replace: its .old- twin is not step N's then either.
    if (e.kind != Entry::kOld || !has_metadata(e.path)) continue;
    std::error_code ec;
    if (fs::exists(fs::symlink_status(fs::path(root) / checkpoint_dir_name(e.step), ec))) continue;
    found.emplace(e.step, e.path.string());
  }
  std::vector<CheckpointDir> out;
  for (auto it = found.rbegin(); it != found.rend(); ++it) out.push_back({it->first, it->second});
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const std::vector<CheckpointDir> all = complete_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.front().path;
}

}  // namespace hp::checkpoint
