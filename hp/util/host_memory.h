// Host memory that a training step frees is kept for the next step.
//
// A step allocates and frees the same activations, gradients and gathered
// parameters every time. glibc's malloc serves the large ones from its heap
// once its mmap threshold has risen to their size (it raises the threshold on
// its own, up to 32 MiB), but it hands free memory at the top of the heap
// back to the kernel whenever that exceeds twice the threshold: at the end
// of every backward, when the step's activations go. The next step faults
// every page in again and the kernel zeroes it: on hp-bench's GPT, thousands
// of faults and about 10 ms of kernel time per step (docs/design.md, "Host
// memory between steps").
//
// retain_freed_host_memory() sets the mmap threshold to kRetainedBlockBytes,
// the most glibc would raise it to itself, and the trim threshold to
// kRetainedTopBytes, so the heap keeps what a step freed. The cost: the
// resident size stays near its peak instead of falling between steps, as a
// caching allocator's does, and the heap holds a little more than the live
// tensors (hp-bench's single row: 22-47 MB more peak RSS, of ~670 MB).
// Blocks above kRetainedBlockBytes are still mapped and unmapped per
// allocation, as without it.
//
// Process-wide and lasting; meant for a program's start (hp-train and
// hp-bench call it first thing). Thread-safe. The environment variable
// HP_RETAIN_HOST_MEMORY=0 makes it change nothing.
#pragma once

#include <cstdint>

namespace hp {

inline constexpr int64_t kRetainedBlockBytes = int64_t{32} << 20;
inline constexpr int64_t kRetainedTopBytes = int64_t{1} << 30;

// True when malloc now keeps freed memory; false, changing nothing, under
// HP_RETAIN_HOST_MEMORY=0 or where the C library is not glibc. Raises
// ArgumentError for another value of HP_RETAIN_HOST_MEMORY than 0 or 1, and
// std::runtime_error if glibc refuses a setting.
bool retain_freed_host_memory();

// While one is alive, host blocks of `min_bytes` or more are mapped on their
// own and unmapped when freed, instead of coming from the heap that
// retain_freed_host_memory keeps. For a phase that allocates and frees large
// blocks between small allocations that stay: building a model on the meta
// device, where each submodule's weights are drawn on the host and dropped
// while the module objects stay. From the heap, each freed block is split by
// the small allocations that follow, the next block no longer fits, and the
// heap grows by most of the model's bytes (hp-train --init meta, 24 blocks
// of d 1024: 705 MiB of free heap, and as much resident peak, while at most
// 48 MiB were live). Ends by restoring kRetainedBlockBytes.
//
// Changes nothing where retain_freed_host_memory is not in force (never
// called, HP_RETAIN_HOST_MEMORY=0, not glibc): glibc's own thresholds move
// on their own and could not be put back. Process-wide while alive (other
// threads' large blocks are mapped too); not to be nested. Throws
// std::runtime_error if glibc refuses the setting.
class ScopedMappedHostBlocks {
 public:
  explicit ScopedMappedHostBlocks(int64_t min_bytes = int64_t{1} << 20);
  ~ScopedMappedHostBlocks();
  ScopedMappedHostBlocks(const ScopedMappedHostBlocks&) = delete;
  ScopedMappedHostBlocks& operator=(const ScopedMappedHostBlocks&) = delete;

  // Whether it changed the threshold (retain_freed_host_memory in force).
  bool active() const { return active_; }

 private:
  bool active_ = false;
};

}  // namespace hp
