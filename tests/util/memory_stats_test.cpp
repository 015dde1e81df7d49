// The counting CPU allocator: counts, peaks, kernels that care about the
// DataPtr's shape, concurrent use, and blocks from before it was installed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "hp/util/memory_stats.h"

namespace hp {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kMiB = 1 << 20;

// Made during static initialisation, i.e. before any test enables tracking.
struct BeforeTracking {
  bool enabled = memory_tracking_enabled();
  std::string stats_error;
  at::Tensor tensor = at::ones({64, 1024});
  // A raw block as oneDNN makes them, freed after tracking started.
  void* raw = c10::GetCPUAllocator()->raw_allocate(4096);
  BeforeTracking() {
    try {
      memory_stats();
    } catch (const std::logic_error& e) {
      stats_error = e.what();
    }
  }
};
BeforeTracking before;

class MemoryStatsTest : public testing::Test {
 protected:
  void SetUp() override { enable_memory_tracking(); }
};

TEST(MemoryStatsOff, StatsBeforeEnablingNameTheFix) {
  EXPECT_FALSE(before.enabled);
  EXPECT_THAT(before.stats_error, HasSubstr("enable_memory_tracking"));
}

TEST_F(MemoryStatsTest, EnablingIsIdempotent) {
  c10::Allocator* installed = c10::GetCPUAllocator();
  enable_memory_tracking();
  EXPECT_EQ(c10::GetCPUAllocator(), installed);
  EXPECT_TRUE(memory_tracking_enabled());
}

TEST_F(MemoryStatsTest, OneMebibyteTensorIsCountedAndReleased) {
  MemoryStats start = memory_stats();
  {
    at::Tensor t = at::empty({kMiB / 4}, at::kFloat);
    MemoryStats during = memory_stats();
    EXPECT_GE(during.current_bytes - start.current_bytes, kMiB);
    EXPECT_GE(during.allocations, start.allocations + 1);
  }
  EXPECT_EQ(memory_stats().current_bytes, start.current_bytes);
}

TEST_F(MemoryStatsTest, EmptyTensorsCostNothing) {
  MemoryStats start = memory_stats();
  at::Tensor t = at::empty({0, 16});
  EXPECT_EQ(memory_stats().current_bytes, start.current_bytes);
  t = at::Tensor();
  EXPECT_EQ(memory_stats().current_bytes, start.current_bytes);
}

TEST_F(MemoryStatsTest, PeakFollowsTheHighestPointUntilReset) {
  reset_peak_memory();
  MemoryStats start = memory_stats();
  EXPECT_EQ(start.peak_bytes, start.current_bytes);
  {
    at::Tensor a = at::empty({4 * kMiB}, at::kByte);
    at::Tensor b = at::empty({2 * kMiB}, at::kByte);
  }
  MemoryStats after = memory_stats();
  EXPECT_EQ(after.current_bytes, start.current_bytes);
  EXPECT_GE(after.peak_bytes, start.current_bytes + 6 * kMiB);

  reset_peak_memory();
  EXPECT_EQ(memory_stats().peak_bytes, start.current_bytes);
  { at::Tensor c = at::empty({kMiB}, at::kByte); }
  MemoryStats phase = memory_stats();
  EXPECT_GE(phase.peak_bytes, start.current_bytes + kMiB);
  EXPECT_LT(phase.peak_bytes, start.current_bytes + 6 * kMiB);
}

// gelu goes through oneDNN, whose buffers come from raw_allocate: it asserts
// context == data on the allocator's DataPtr.
TEST_F(MemoryStatsTest, GeluMatmulAndBackwardRun) {
  MemoryStats start = memory_stats();
  at::Tensor x = at::linspace(-3, 3, 4096).reshape({64, 64});
  at::Tensor expected = 0.5 * x * (1 + at::erf(x / std::sqrt(2.0)));
  EXPECT_TRUE(at::allclose(at::gelu(x), expected, 1e-5, 1e-6));

  at::Tensor eye = at::eye(64);
  EXPECT_TRUE(at::equal(at::matmul(x, eye), x));

  at::Tensor w = at::randn({64, 64}).requires_grad_(true);
  at::Tensor loss = at::gelu(at::matmul(x, w)).sum();
  loss.backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().sizes(), w.sizes());
  EXPECT_TRUE(at::isfinite(w.grad()).all().item<bool>());
  EXPECT_GT(memory_stats().allocations, start.allocations);
}

TEST_F(MemoryStatsTest, ConcurrentAllocationsKeepCountersConsistent) {
  MemoryStats start = memory_stats();
  constexpr int kThreads = 4;
  constexpr int kRounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([t] {
      std::vector<at::Tensor> kept;
      for (int i = 0; i < kRounds; ++i) {
        kept.push_back(at::empty({(i % 7 + 1) * 1000 + t}, at::kByte));
        if (kept.size() == 8) kept.erase(kept.begin(), kept.begin() + 5);
      }
    });
  }
  for (auto& th : threads) th.join();
  MemoryStats end = memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_GE(end.allocations - start.allocations, kThreads * kRounds);
  EXPECT_GE(end.peak_bytes, start.current_bytes + 1000);
}

// Tensors freed on another thread than the one that allocated them, as
// Gloo's and the autograd engine's threads do.
TEST_F(MemoryStatsTest, FreeingOnAnotherThreadIsCounted) {
  MemoryStats start = memory_stats();
  std::vector<at::Tensor> made;
  for (int i = 0; i < 100; ++i) made.push_back(at::empty({1024 + i}, at::kByte));
  EXPECT_GE(memory_stats().current_bytes, start.current_bytes + 100 * 1024);
  std::thread([moved = std::move(made)]() mutable { moved.clear(); }).join();
  EXPECT_EQ(memory_stats().current_bytes, start.current_bytes);
}

TEST_F(MemoryStatsTest, BlocksFromBeforeTrackingFreeWithoutUnderflow) {
  MemoryStats start = memory_stats();
  EXPECT_FLOAT_EQ(before.tensor.sum().item<float>(), 64 * 1024);
  before.tensor = at::Tensor();
  ASSERT_NE(before.raw, nullptr);
  c10::GetCPUAllocator()->raw_deallocate(before.raw);
  before.raw = nullptr;
  MemoryStats end = memory_stats();
  EXPECT_EQ(end.current_bytes, start.current_bytes);
  EXPECT_GE(end.current_bytes, 0);
}

TEST_F(MemoryStatsTest, RawAllocationsAreCounted) {
  MemoryStats start = memory_stats();
  c10::Allocator* allocator = c10::GetCPUAllocator();
  void* p = allocator->raw_allocate(10000);
  EXPECT_EQ(memory_stats().current_bytes, start.current_bytes + 10000);
  allocator->raw_deallocate(p);
  EXPECT_EQ(memory_stats().current_bytes, start.current_bytes);
}

}  // namespace
}  // namespace hp
