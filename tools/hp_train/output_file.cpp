#include "tools/hp_train/output_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "hp/util/error.h"

namespace hp::train {

std::ofstream open_output_file(const std::string& flag, const std::string& path) {
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  std::error_code error;
  if (!folder.empty()) std::filesystem::create_directories(folder, error);
  HP_CHECK_ARG(!error, flag, " '", path, "': cannot create the folder '", folder.string(),
               "': ", error.message());
  errno = 0;
  std::ofstream out(path, std::ios::trunc);
  // std::ofstream keeps the reason to itself; open(2) left it in errno.
  HP_CHECK_ARG(out.is_open(), flag, " '", path, "' cannot be opened for writing: ",
               errno != 0 ? std::strerror(errno) : "unknown reason");
  return out;
}

std::string trace_path(const std::string& path, int rank) {
  const auto slash = path.find_last_of('/');
  const auto dot = path.find_last_of('.');
  const bool has_extension = dot != std::string::npos && (slash == std::string::npos || dot > slash);
  const std::string stem = has_extension ? path.substr(0, dot) : path;
  const std::string extension = has_extension ? path.substr(dot) : ".json";
  return fmt::format("{}.rank{}{}", stem, rank, extension);
}

}  // namespace hp::train
