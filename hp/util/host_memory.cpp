#include "hp/util/host_memory.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "hp/util/env.h"
#include "hp/util/error.h"

namespace hp {

namespace {

// Whether retain_freed_host_memory set glibc's thresholds.
std::atomic<bool> g_retaining{false};

void set_mmap_threshold(int64_t bytes) {
#if defined(__GLIBC__)
  if (mallopt(M_MMAP_THRESHOLD, static_cast<int>(bytes)) != 1) {
    throw std::runtime_error(cat("glibc refused M_MMAP_THRESHOLD = ", bytes, " bytes"));
  }
#else
  (void)bytes;
#endif
}

}  // namespace

ScopedMappedHostBlocks::ScopedMappedHostBlocks(int64_t min_bytes) {
  HP_CHECK_ARG(min_bytes > 0 && min_bytes <= kRetainedBlockBytes,
               "ScopedMappedHostBlocks: min_bytes ", min_bytes, " must be in (0, ",
               kRetainedBlockBytes, "]");
  if (!g_retaining.load()) return;
  set_mmap_threshold(min_bytes);
  active_ = true;
}

ScopedMappedHostBlocks::~ScopedMappedHostBlocks() {
  if (!active_) return;
  try {
    set_mmap_threshold(kRetainedBlockBytes);
  } catch (const std::exception&) {
    // glibc took this very value before; a destructor cannot report more.
  }
}

bool retain_freed_host_memory() {
  // 0: leave malloc as it is; 1 (the default): keep freed memory.
  if (!hp::env::get_bool("HP_RETAIN_HOST_MEMORY", true)) return false;
  // Not under AddressSanitizer: malloc is then ASan's own allocator, to
  // which glibc's thresholds mean nothing (its mallopt does nothing and
  // returns 0); docs/design.md, "Sanitizers".
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__)
  // Setting either threshold also stops glibc from moving them on its own.
  set_mmap_threshold(kRetainedBlockBytes);
  if (mallopt(M_TRIM_THRESHOLD, static_cast<int>(kRetainedTopBytes)) != 1) {
    throw std::runtime_error(cat("glibc refused M_TRIM_THRESHOLD = ", kRetainedTopBytes, " bytes"));
  }
  g_retaining.store(true);
  return true;
#else
  return false;
#endif
}

}  // namespace hp
