// retain_freed_host_memory: memory a step freed is not faulted in again by
// the next, and a model built on meta leaves no weights in the heap
// (ScopedMappedHostBlocks). Its own binary: the settings are process-wide
// and lasting, and the tests depend on the heap this process has made.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <malloc.h>
#include <sys/resource.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "hp/nn/gpt.h"
#include "hp/util/error.h"
#include "hp/util/host_memory.h"

namespace hp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// One "step": the activations of a training step, allocated one after
// another and all freed at its end.
constexpr int64_t kBlockBytes = int64_t{2} << 20;
constexpr int kBlocks = 48;

int64_t minor_faults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Page faults of one step (fill_ touches every page of every block).
int64_t faults_of_one_step() {
  const int64_t before = minor_faults();
  {
    std::vector<at::Tensor> blocks;
    for (int i = 0; i < kBlocks; ++i) blocks.push_back(at::empty({kBlockBytes / 4}).fill_(1.0f));
    while (!blocks.empty()) blocks.pop_back();  // the last allocated first, as backward frees
  }
  return minor_faults() - before;
}

// Building a model on meta draws each block's weights on the host and drops
// them while the block's module objects stay. GPT's meta constructor holds a
// ScopedMappedHostBlocks, so weights of 1 MiB or more are mapped on their own
// and leave nothing in the heap; from the heap, each block's weights would
// be split by the objects that follow, the next block's would not fit the
// hole, and the heap would grow by most of the weights (here 16 blocks of
// 12 MiB: it grew by 117 MiB without the guard, by 1.6 MiB with it). What may reach the heap: the tensors under 1 MiB
// (drawn once each, so at most their sum even if no hole were reused), and
// the modules' own objects, names and malloc's top padding, under 1 MiB for
// a model of 16 blocks.
// First in this binary: the heap holds no free space yet that the blocks
// could fall into whatever the guard does.
TEST(HostMemory, BuildingOnMetaLeavesNoWeightsInTheHeap) {
  ::unsetenv("HP_RETAIN_HOST_MEMORY");
  ASSERT_TRUE(retain_freed_host_memory());
  nn::GPTConfig config;
  config.vocab_size = 256;
  config.context = 256;
  config.n_layer = 16;
  config.n_head = 8;
  config.n_embd = 512;  // a block's weights: 3, 1, 4 and 4 MiB
  const auto before = static_cast<int64_t>(mallinfo2().arena);
  nn::GPT model(config, at::kMeta);
  const int64_t growth = static_cast<int64_t>(mallinfo2().arena) - before;
  int64_t small_bytes = 0, large_bytes = 0;
  for (const auto& p : model->parameters()) {
    const auto bytes = static_cast<int64_t>(p.numel() * p.element_size());
    (bytes < (int64_t{1} << 20) ? small_bytes : large_bytes) += bytes;
  }
  EXPECT_LE(growth, small_bytes + (int64_t{1} << 20))
      << "the heap grew by " << growth << " bytes while building on meta; the model's tensors "
      << "under 1 MiB are " << small_bytes << " bytes, its larger ones " << large_bytes;
  for (const auto& p : model->parameters()) ASSERT_TRUE(p.is_meta());
}

TEST(HostMemory, FreedStepMemoryIsReusedWithoutFaults) {
  // Where glibc's thresholds start (128 KiB each), so that the first half
  // does not depend on what this process allocated before: each block is
  // mapped afresh, or the heap's top trimmed after the step.
  ASSERT_EQ(mallopt(M_MMAP_THRESHOLD, 128 << 10), 1);
  ASSERT_EQ(mallopt(M_TRIM_THRESHOLD, 128 << 10), 1);

  // HP_RETAIN_HOST_MEMORY=0 leaves malloc so: every step faults its blocks
  // in again, at least once per 2 MiB even where the kernel backs them with
  // huge pages (24576 faults with 4 KiB pages).
  ::setenv("HP_RETAIN_HOST_MEMORY", "0", 1);
  EXPECT_FALSE(retain_freed_host_memory());
  faults_of_one_step();
  const int64_t fresh = faults_of_one_step();
  ASSERT_GE(fresh, kBlocks * kBlockBytes / (int64_t{2} << 20));

  // Both thresholds matter: with only the mmap threshold raised the step's
  // blocks come from the heap but its top is trimmed after each step; with
  // only the trim threshold, every block is still mapped afresh.
  ::setenv("HP_RETAIN_HOST_MEMORY", "1", 1);
  ASSERT_TRUE(retain_freed_host_memory());
  // The heap grows to hold a step once; libtorch's 64-byte aligned requests
  // are a little larger than the blocks they leave, so a step or two more
  // may still grow it while freed blocks merge.
  constexpr int kWarmSteps = 8;
  std::vector<int64_t> faults;
  for (int step = 0; step < kWarmSteps + 3; ++step) faults.push_back(faults_of_one_step());
  // From then on the heap holds still: what may still fault is the test's
  // own bookkeeping, a few small pages (none, here). A single block handed
  // back to the kernel and faulted in again costs fresh / kBlocks (512 with
  // 4 KiB pages), which is the bound.
  for (int step = kWarmSteps; step < kWarmSteps + 3; ++step) {
    EXPECT_LT(faults[step], fresh / kBlocks)
        << "faults per step: " << ::testing::PrintToString(faults);
  }
  ::unsetenv("HP_RETAIN_HOST_MEMORY");
}

TEST(HostMemory, RejectsAnotherSettingNamingIt) {
  ::setenv("HP_RETAIN_HOST_MEMORY", "maybe", 1);
  try {
    retain_freed_host_memory();
    ADD_FAILURE() << "expected ArgumentError";
  } catch (const ArgumentError& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("HP_RETAIN_HOST_MEMORY"), HasSubstr("'maybe'"),
                                HasSubstr("1/0, true/false")));
  }
  ::unsetenv("HP_RETAIN_HOST_MEMORY");
}

}  // namespace
}  // namespace hp
