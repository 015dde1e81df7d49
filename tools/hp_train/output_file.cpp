#include "tools/hp_train/output_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

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

}  // namespace hp::train
