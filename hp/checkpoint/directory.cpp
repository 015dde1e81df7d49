#include "hp/checkpoint/directory.h"

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <regex>
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

std::string commit_dir(const std::string& root, const std::string& temp, int64_t step) {
  const fs::path final_path = fs::path(root) / checkpoint_dir_name(step);
  const fs::path old = fs::path(root) / (".old-" + checkpoint_dir_name(step));
  std::error_code ec;
  const bool replacing = fs::exists(final_path, ec);
  if (replacing) {
    fs::remove_all(old, ec);
    rename_or_fail(final_path, old);
  }
  rename_or_fail(temp, final_path);
  fsync_directory(root);
  if (replacing) fs::remove_all(old, ec);
  return final_path.string();
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  static const std::regex kName("step-([0-9]+)");
  std::error_code ec;
  std::optional<int64_t> best;
  std::string best_path;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::smatch match;
    if (!std::regex_match(name, match, kName)) continue;
    // A step directory appears only by the commit's rename of a real
    // directory, after its metadata; a link, or a directory without
    // metadata, is someone else's: skip it. The metadata itself is checked
    // when it is read (a link or a FIFO there is refused with its name).
    std::error_code type_ec;
    if (!fs::is_directory(fs::symlink_status(it->path(), type_ec))) continue;
    if (!fs::exists(fs::symlink_status(it->path() / kMetadataFile, type_ec))) continue;
    const std::string digits = match[1].str();
    int64_t step = 0;
    const auto [end_of_number, parse_ec] =
        std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (parse_ec != std::errc() || end_of_number != digits.data() + digits.size()) {
      fail_directory(it->path().string(),
                     cat("step ", digits, " is beyond the largest step a save writes, ",
                         INT64_MAX));
    }
    if (!best || step > *best) {
      best = step;
      best_path = it->path().string();
    }
  }
  if (!best) return std::nullopt;
  return best_path;
}

}  // namespace hp::checkpoint
