#include "hp/util/memory_stats.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "hp/util/torch_compat.h"

namespace hp {
namespace {

// The size of a block has to be known when it is freed, and the deleter
// receives only the data pointer: kernels assert context == data (e.g.
// Allocator::raw_allocate, which oneDNN's gelu uses), so no per-block context
// object can carry it. A header in front of each block would be cheaper, but
// oneDNN allocates with GetCPUAllocator()->raw_allocate and frees with a fresh
// GetCPUAllocator()->raw_deallocate: a buffer it allocated before tracking was
// enabled reaches our deleter, and reading a header in front of it would
// corrupt the heap. So blocks are remembered in a map, which tells ours from
// foreign ones; it is split into stripes with a mutex each because tensors
// are allocated and freed from several threads (Gloo's, the autograd
// engine's, intra-op workers).
struct Block {
  int64_t bytes;
  void* context;  // what the wrapped allocator needs to free it
  c10::DeleterFnPtr deleter;
};

constexpr int kStripeBits = 4;
constexpr size_t kStripes = size_t{1} << kStripeBits;

struct Stripe {
  std::mutex mutex;
  std::unordered_map<void*, Block> blocks;
};

struct Tracker {
  c10::Allocator* wrapped = nullptr;
  std::array<Stripe, kStripes> stripes;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> allocations{0};

  Stripe& stripe_of(const void* ptr) {
    // Blocks are 64-byte aligned: drop the low bits, then mix.
    uint64_t h = (reinterpret_cast<uintptr_t>(ptr) >> 6) * 0x9E3779B97F4A7C15ull;
    return stripes[h >> (64 - kStripeBits)];
  }

  void add(int64_t bytes) {
    allocations.fetch_add(1, std::memory_order_relaxed);
    int64_t now = current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
};

// Never destroyed: tensors are still freed during static destruction.
Tracker* g_tracker = nullptr;
thread_local int64_t t_thread_allocations = 0;
std::atomic<bool> g_enabled{false};
std::once_flag g_install_once;

void counting_delete(void* ptr) {
  if (ptr == nullptr) return;
  Tracker& t = *g_tracker;
  Stripe& s = t.stripe_of(ptr);
  Block block{0, nullptr, nullptr};
  bool ours = false;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.blocks.find(ptr);
    if (it != s.blocks.end()) {
      block = it->second;
      s.blocks.erase(it);
      ours = true;
    }
  }
  if (!ours) {
    // A raw block of the wrapped allocator from before tracking started.
    c10::DeleterFnPtr raw = t.wrapped->raw_deleter();
    TORCH_INTERNAL_ASSERT(raw != nullptr, "memory tracking: cannot free unknown block ", ptr);
    raw(ptr);
    return;
  }
  t.current.fetch_sub(block.bytes, std::memory_order_relaxed);
  if (block.deleter != nullptr) block.deleter(block.context);
}

class CountingAllocator final : public compat::CountingAllocatorBase {
 public:
  c10::DataPtr allocate_bytes(size_t nbytes) const override {
    Tracker& t = *g_tracker;
    c10::DataPtr inner = t.wrapped->allocate(nbytes);
    void* data = inner.get();
    if (data == nullptr) return inner;  // zero bytes: nothing to count or free
    c10::Device device = inner.device();
    Block block{static_cast<int64_t>(nbytes), inner.get_context(), inner.get_deleter()};
    {
      Stripe& s = t.stripe_of(data);
      std::lock_guard<std::mutex> lock(s.mutex);
      s.blocks.emplace(data, block);
    }
    // From here on the block is freed through counting_delete only.
    inner.release_context();
    t.add(block.bytes);
    ++t_thread_allocations;
    return {data, data, &counting_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
};

Tracker& enabled_tracker(const char* caller) {
  if (!g_enabled.load(std::memory_order_acquire)) {
    throw std::logic_error(std::string(caller) +
                           ": memory tracking is off; call hp::enable_memory_tracking() first "
                           "(before the allocations to be measured)");
  }
  return *g_tracker;
}

}  // namespace

int64_t thread_allocation_count() { return t_thread_allocations; }

void enable_memory_tracking() {
  std::call_once(g_install_once, [] {
    g_tracker = new Tracker();
    g_tracker->wrapped = c10::GetCPUAllocator();
    auto* allocator = new CountingAllocator();  // never destroyed, as g_tracker
    c10::SetCPUAllocator(allocator);
    // SetCPUAllocator ignores an allocator of lower priority than the
    // current one; counting nothing silently would be worse than failing.
    if (c10::GetCPUAllocator() != allocator) {
      throw std::runtime_error(
          "enable_memory_tracking: libtorch kept its CPU allocator (one was registered with a "
          "higher priority), so memory cannot be tracked");
    }
    g_enabled.store(true, std::memory_order_release);
  });
}

bool memory_tracking_enabled() { return g_enabled.load(std::memory_order_acquire); }

MemoryStats memory_stats() {
  Tracker& t = enabled_tracker("memory_stats");
  MemoryStats stats;
  stats.current_bytes = t.current.load(std::memory_order_relaxed);
  stats.peak_bytes = t.peak.load(std::memory_order_relaxed);
  stats.allocations = t.allocations.load(std::memory_order_relaxed);
  return stats;
}

void reset_peak_memory() {
  Tracker& t = enabled_tracker("reset_peak_memory");
  t.peak.store(t.current.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

}  // namespace hp
