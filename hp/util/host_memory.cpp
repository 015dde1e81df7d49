#include "hp/util/host_memory.h"

#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "hp/util/error.h"

namespace hp {

bool retain_freed_host_memory() {
  if (const char* setting = std::getenv("HP_RETAIN_HOST_MEMORY")) {
    const std::string value = setting;
    HP_CHECK_ARG(value == "0" || value == "1", "HP_RETAIN_HOST_MEMORY is '", value,
                 "', expected 0 (leave malloc as it is) or 1 (keep freed memory)");
    if (value == "0") return false;
  }
#if defined(__GLIBC__)
  // Setting either threshold also stops glibc from moving them on its own.
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(kRetainedBlockBytes)) != 1) {
    throw std::runtime_error(
        cat("glibc refused M_MMAP_THRESHOLD = ", kRetainedBlockBytes, " bytes"));
  }
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(kRetainedTopBytes)) != 1) {
    throw std::runtime_error(cat("glibc refused M_TRIM_THRESHOLD = ", kRetainedTopBytes, " bytes"));
  }
  return true;
#else
  return false;
#endif
}

}  // namespace hp
