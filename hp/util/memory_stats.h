// Live CPU memory of this process, as libtorch allocates it.
//
// The memory invariant of docs/design.md (1/N of the parameters, gradients
// and optimizer state per rank, plus the unsharded working set) is
// measured, not assumed:
// enable_memory_tracking() wraps libtorch's CPU allocator in one that counts
// the bytes it hands out and takes back. Only memory allocated through it is
// counted: blocks that existed before tracking was enabled are invisible, and
// freeing them later leaves the counters alone. Tracking cannot be turned off
// again (tensors alive at that point would carry its deleter).
#pragma once

#include <cstdint>

namespace hp {

struct MemoryStats {
  int64_t current_bytes = 0;  // bytes allocated and not yet freed
  int64_t peak_bytes = 0;     // highest current_bytes since enabling or the last reset
  int64_t allocations = 0;    // blocks handed out since enabling (cumulative)
};

// Installs the counting allocator as libtorch's CPU allocator (wrapping the
// one installed before). Idempotent and thread-safe.
void enable_memory_tracking();

bool memory_tracking_enabled();

// Throws std::logic_error naming enable_memory_tracking() when tracking is off.
MemoryStats memory_stats();

// Sets peak_bytes to current_bytes, so the next peak covers one phase (a
// step, a forward). Throws as memory_stats() does when tracking is off.
void reset_peak_memory();

// Blocks handed out on the calling thread since enabling (0 while tracking
// is off), for observers that attribute allocations to the code running on
// a thread (hp/util/op_profile.h). Never throws.
int64_t thread_allocation_count();

}  // namespace hp
